"""The policy-worker integration: what a Megatron policy worker calls to get its metrics.

A worker adopts it in a few lines::

    metrics = PolicyMetrics(megatron_cfg.metrics(), vocab_size=padded_vocab_size)
    metrics.attach(model_chunks, transformer_config)       # once, after building the model
    for global_batch in batches:                            # one optimizer step each
        with metrics.step():
            for microbatch in ...:                          # inside forward_step_func
                metrics.microbatch(seq_lens=attention_mask.sum(-1))
                ...forward, backward...
            optimizer.step()
        step_metrics = metrics.finish_step(num_microbatches=n)   # collective: every rank calls it
        results.update(step_metrics)

``finish_step`` returns the same dict on every rank, with keys exactly as in
``nemo_moe_metrics.metric_names``; loops merge it as is (no extra prefix).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics.config import MetricsConfig

log = logging.getLogger(__name__)


class PolicyMetrics:
    """Attaches what the metric flags ask for to a model and turns each step into metrics."""

    def __init__(self, cfg: MetricsConfig, *, vocab_size: int | None = None) -> None:
        """``vocab_size`` sizes the lm_head in the FLOP estimate (megatron configs lack it)."""
        self.cfg = cfg
        self.vocab_size = vocab_size
        self._transformer_config: Any = None
        self._track_moe = False
        self._collector: Any = None
        self._reducer: Any = None
        self._ep_size = 1
        self._meter: Any = None
        self._attached = False

    @property
    def active(self) -> bool:
        """Whether anything is measured (False: every call is a no-op)."""
        return self._track_moe or self._meter is not None

    def attach(self, model: nn.Module | list[nn.Module], transformer_config: Any) -> None:
        """Hook the model chunks as the flags say; nothing at all when they are off or not MoE."""
        if self._attached:
            raise RuntimeError("PolicyMetrics.attach() was already called; attach once per model")
        self._attached = True
        self._transformer_config = transformer_config
        chunks = model if isinstance(model, list | tuple) else [model]
        if self.cfg.track_moe_metrics:
            self._attach_moe(chunks, transformer_config)
        if self.cfg.track_throughput:
            self._meter = self._build_meter(transformer_config)

    def _attach_moe(self, chunks: list[nn.Module], transformer_config: Any) -> None:
        from nemo_moe_metrics.moe.hooks import ExpertLoadCollector
        from nemo_moe_metrics.moe.reduction import ExpertLoadReducer

        # Decided from the config, not from this rank's modules: a pipeline stage without MoE
        # layers must still join every collective the other stages make.
        if not getattr(transformer_config, "num_moe_experts", None):
            log.warning(
                "track_moe_metrics is on but the model has no MoE layers: no moe/ metrics, no hooks"
            )
            return
        self._track_moe = True
        self._collector = ExpertLoadCollector.attach(chunks)
        self._reducer = ExpertLoadReducer(None)
        self._ep_size = int(getattr(transformer_config, "expert_model_parallel_size", 1) or 1)

    def _build_meter(self, transformer_config: Any) -> Any:
        from nemo_moe_metrics.throughput import StepMeter

        estimator, peak = None, None
        if self.cfg.track_flops:
            from nemo_moe_metrics.flops import resolve_peak_flops, try_get_flops_estimator

            # Unknown model type: one warning and no FLOP keys, never a reported 0.
            estimator = try_get_flops_estimator(transformer_config, vocab_size=self.vocab_size)
            device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            if estimator is not None:
                peak = resolve_peak_flops(device_name, self.cfg.peak_flops_per_gpu)
        data_group = None
        if dist.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                data_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        return StepMeter(
            flops_estimator=estimator, peak_flops_per_gpu=peak, device=device, data_group=data_group
        )

    def resume_totals(
        self, total_tokens: float, total_seconds: float, total_flops: float = 0.0
    ) -> None:
        """Continue ``train_perf/total_*`` and the cumulative rates of a resumed run (after
        ``attach``, before the first step); a no-op without throughput tracking."""
        if self._meter is not None:
            self._meter.resume(total_tokens, total_seconds, total_flops)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Bracket one optimizer step; a step that raises leaves no partial counts behind."""
        try:
            if self._meter is not None:
                with self._meter.step():
                    yield
            else:
                yield
        except BaseException:
            self._discard_partial_step()
            raise

    def _discard_partial_step(self) -> None:
        if self._collector is not None:
            self._collector.reset()
        if self._track_moe:
            from nemo_moe_metrics.moe.aux_loss import clear_aux_loss_tracker

            clear_aux_loss_tracker()

    def microbatch(self, seq_lens: torch.Tensor) -> None:
        """Record one training microbatch: real (non-padding) length of each sequence, on device."""
        if self._meter is not None:
            self._meter.add_sequences(seq_lens)

    def finish_step(self, num_microbatches: int) -> dict[str, Any]:
        """Reduce across ranks and return the step's metrics; collective, same dict on every rank.

        Any error keeps its type and gains a note naming the export and the likely cause, so a
        collective timeout or a closed connection (a rank that failed earlier) reads as such.
        """
        try:
            return self._finish_step(num_microbatches)
        except Exception as err:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            err.add_note(
                f"nemo_moe_metrics: PolicyMetrics.finish_step failed on rank {rank} during the "
                "metrics export, a collective every rank must join after each step. A timeout or "
                "'Connection closed by peer' here means another rank failed earlier or skipped "
                "finish_step: look for the first error in the other ranks' logs."
            )
            raise

    def _finish_step(self, num_microbatches: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._track_moe:
            from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics
            from nemo_moe_metrics.moe.balance import expert_load_metrics
            from nemo_moe_metrics.moe.reduction import export_expert_loads

            out.update(
                aux_loss_metrics(
                    self._transformer_config,
                    num_microbatches=num_microbatches,
                    per_layer=self.cfg.moe_per_layer_logging,
                )
            )
            loads = export_expert_loads(self._collector, reducer=self._reducer)
            out.update(
                expert_load_metrics(
                    loads,
                    per_layer=self.cfg.moe_per_layer_logging,
                    table=self.cfg.log_expert_table,
                    ep_size=self._ep_size,
                )
            )
        if self._meter is not None:
            out.update(self._meter.export())
        return out

    def detach(self) -> None:
        """Remove every hook (the model runs exactly as before)."""
        if self._collector is not None:
            self._collector.detach()
            self._collector = None
