"""Throughput: step time, tokens and FLOPs (``train_perf/``), from a :class:`StepMeter`.

The meter (``nemo_moe_metrics.throughput``) owns the timing and the token and FLOP accounting;
this module builds it from the flags and the model (the FLOP estimator, the peak, the process
groups) and checks each microbatch's lengths against the batch the model's next forward takes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending, collective_device
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.flops import FlopsEstimator, UnknownModelTypeError, resolve_peak_flops
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.moe.imbalance_cost import routed_flops_per_token
from nemo_moe_metrics.throughput import StepMeter

_INPUT_KEYS = ("input_ids", "tokens", "inputs_embeds", "input")


def _input_rows_and_width(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """``(sequences, positions per sequence)`` of a model's token input, from its shape."""
    found = next((kwargs[k] for k in _INPUT_KEYS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if found is None and args and isinstance(args[0], torch.Tensor):
        found = args[0]
    if found is None or found.dim() < 2 or found.is_floating_point() and found.dim() < 3:
        return None  # no [batch, seq] token ids (or [batch, seq, hidden] embeddings) to read
    return int(found.shape[0]), int(found.shape[1])


class Throughput(MetricFamily):
    """Step time, tokens and FLOPs (``train_perf/``), from a :class:`StepMeter`."""

    def __init__(
        self,
        meter: StepMeter,
        chunks: list[nn.Module],
        routed_flops_per_token: float | None = None,
    ) -> None:
        """Hooks each chunk's forward to see the batch a microbatch's lengths were for;
        ``routed_flops_per_token``: the estimator's routed-experts FLOPs per token (None
        without an estimator), for ``expert_imbalance_slowdown``."""
        self.meter = meter
        self.routed_flops_per_token = routed_flops_per_token
        self._in_step = False
        # len(seq_lens) of the last microbatch() call until a training forward of a chunk
        # shows the batch it was for (see _note_model_input).
        self._awaiting_forward: int | None = None
        self._hooks = [
            chunk.register_forward_pre_hook(self._note_model_input, with_kwargs=True)
            for chunk in chunks
        ]

    def enter_step(self) -> None:
        self._in_step = True
        self._awaiting_forward = None

    def leave_step(self) -> None:
        self._in_step = False

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        with self.meter.step():
            yield

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        self.meter.add_sequences(seq_lens)
        self._awaiting_forward = num_sequences

    def restart(self) -> None:
        self.meter.discard_step_sequences()
        self._awaiting_forward = None

    def resume(
        self, total_tokens: float, total_seconds: float, total_flops: float, restart: bool
    ) -> None:
        self.meter.resume(total_tokens, total_seconds, total_flops, restart=restart)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [self.meter.enqueue()]

    def check(self, out: dict[str, Any], microbatches: int) -> None:
        # out holds the tokens already reduced over every rank (read at export anyway), so
        # every rank takes this branch together; only then one more tiny collective asks
        # whether any rank called microbatch() (zero-length sequences are a valid 0 tokens).
        if out.get(mn.TOKENS) != 0:
            return
        calls = microbatches
        if dist.is_available() and dist.is_initialized():
            total = torch.tensor([calls], dtype=torch.int64, device=collective_device())
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            calls = int(total.item())
        if calls == 0:
            raise RuntimeError(
                "PolicyMetrics.finish_step: track_throughput is on but no rank called "
                "microbatch() since the last finish_step, so train_perf/ would report 0 tokens. "
                "Call metrics.microbatch(seq_lens=...) once per microbatch inside "
                "`with metrics.step():` (e.g. in forward_step_func)."
            )

    def _note_model_input(self, chunk: nn.Module, args: tuple, kwargs: dict) -> None:
        # The first training forward of a chunk after microbatch() shows the batch the lengths
        # were for: its input's shape (metadata only, no host read). One length per row; a
        # single row ([1, total], THD packing) holds any number of packed sequences.
        if not (self._in_step and chunk.training and torch.is_grad_enabled()):
            return  # a no-grad or eval forward (reference scoring) is not the microbatch's
        count, self._awaiting_forward = self._awaiting_forward, None
        if count is None:
            return
        rows_and_width = _input_rows_and_width(args, kwargs)
        if rows_and_width is None:  # e.g. a middle pipeline stage (no token input)
            return
        rows, width = rows_and_width
        if compat.context_parallel_size() == 1:  # a CP rank's input holds part of each sequence
            self.meter.note_positions(rows * width)
        if count != rows and rows > 1:
            self.meter.reject(
                f"microbatch(seq_lens=...) got {count} length(s) but the model's next forward "
                f"took a batch of {rows} sequences ({rows} x {width}); pass one real-token "
                "count per sequence of that batch, e.g. attention_mask.sum(-1) (sequences "
                "packed into one row, [1, total], pass one length per packed sequence)"
            )

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def flops_estimator(context: BuildContext) -> FlopsEstimator | None:
    """The model family's FLOP estimator with ``track_flops``; None (one warning, never a
    reported 0) for a model type without one. A transformers model without a formula is read
    from its own modules, once here."""
    if not context.cfg.track_flops:
        return None
    chunks = context.chunks
    model = chunks[0] if len(chunks) == 1 else None
    try:
        return context.model_family.flops(context.config, context.vocab_size, model)
    except UnknownModelTypeError as err:
        warnings.warn(f"FLOP metrics disabled: {err}", stacklevel=5)
        return None


def build(context: BuildContext) -> Throughput | None:
    """With ``track_throughput``: a step meter with the FLOP estimator and the accelerator's
    peak (``track_flops``)."""
    cfg = context.cfg
    if not cfg.track_throughput:
        return None
    estimator, peak, per_token = flops_estimator(context), None, None
    if cfg.track_flops:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        if estimator is not None:
            peak = resolve_peak_flops(device_name, cfg.peak_flops_per_gpu)
            per_token = routed_flops_per_token(estimator)
    # None: every rank a data-parallel replica (DDP, FSDP)
    data_group = compat.data_parallel_group() if dist.is_initialized() else None
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    host_timing_group = None
    if device is not None and dist.is_initialized() and dist.get_backend() != "gloo":
        # CUDA events: the step seconds' MAX goes host to host, so the export waits once.
        # Creating a group is collective: every rank attaches with the same flags.
        host_timing_group = dist.new_group(backend="gloo")
    meter = StepMeter(
        flops_estimator=estimator,
        peak_flops_per_gpu=peak,
        device=device,
        data_group=data_group,
        host_timing_group=host_timing_group,
    )
    return Throughput(meter, context.chunks, per_token)


__all__ = ["Throughput", "build", "flops_estimator"]
