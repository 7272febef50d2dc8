"""The policy-worker integration: what a training worker calls to get its metrics.

A worker adopts it with five calls, the constructor and four methods (docs/en/integration.md)::

    metrics = PolicyMetrics(metrics_cfg, vocab_size=padded_vocab_size)  # megatron: lm_head size
    metrics.attach(model_chunks, config)    # once; megatron TransformerConfig or HF model.config
    for global_batch in batches:            # one optimizer step each
        with metrics.step():
            for microbatch in ...:          # inside forward_step_func
                metrics.microbatch(seq_lens=attention_mask.sum(-1))
                ...forward, backward...
            optimizer.step()
        step_metrics = metrics.finish_step(num_microbatches=n)   # collective: every rank calls it
        results.update(step_metrics)

``seq_lens`` counts, per sequence of the microbatch, its real tokens: padding excluded, each
packed sequence separately (``attention_mask.sum(-1)`` with a transformers mask, 1 = real token;
``(~padding_mask).sum(-1)`` with megatron's, True = padding; ``lengths_from_cu_seqlens`` when
packed).

``finish_step`` returns the same dict on every rank, with keys exactly as in
``nemo_moe_metrics.metric_names``; loops merge it as is (no extra prefix).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics import metric_names as mn
from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.host_read import Pending, done, read_once

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the worker needs to know about a model, read from its config."""

    num_experts: int  #: routed experts per MoE layer; 0 for a dense model
    num_layers: int  #: decoder layers (global layer ids index into them)
    ep_size: int  #: expert-parallel ranks (1 for Hugging Face models)
    aux_loss: Literal["megatron", "hf"] | None  #: where aux losses come from; None: none
    #: which kind of config described the model
    source: Literal["megatron", "hf", "torchtitan"] = "megatron"
    model_type: str | None = None  #: the Hugging Face model_type (None for megatron)
    expert_bias: bool = False  #: routers keep an aux-loss-free expert bias (moe/expert_bias.py)


def model_facts(config: Any) -> ModelFacts:
    """The adapter: a transformers ``PretrainedConfig`` or a megatron ``TransformerConfig``.

    FLOPs need no adapter: ``nemo_moe_metrics.flops`` takes either config type.
    """
    from nemo_moe_metrics.moe.torchtitan import is_torchtitan_config, torchtitan_model_facts

    if is_torchtitan_config(config):  # torchtitan's model config (e.g. DeepSeekV3Model.Config)
        experts, layers, bias = torchtitan_model_facts(config)
        return ModelFacts(experts, layers, 1, None, "torchtitan", expert_bias=bias)
    if isinstance(config, Mapping) and "model_type" in config:  # a config.json dict
        from transformers import AutoConfig

        data = {k: v for k, v in config.items() if k != "model_type"}
        config = AutoConfig.for_model(config["model_type"], **data)
    transformers = sys.modules.get("transformers")  # a PretrainedConfig means it is imported
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        from nemo_moe_metrics.moe.hf_models import config_num_experts

        text = config.get_text_config()  # composite configs (qwen3_5_moe) keep it inside
        experts = config_num_experts(text)
        # Whether the model computes a load-balancing loss is read from the model at attach.
        aux = "hf" if experts else None
        layers = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layers", 0) or 0)
        model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
        return ModelFacts(experts, layers, 1, aux, "hf", model_type)
    if not hasattr(config, "num_layers"):
        raise TypeError(
            f"PolicyMetrics.attach(model, config): config is a {type(config).__name__}; pass the "
            "model's megatron-core TransformerConfig or its transformers PretrainedConfig "
            "(model.config, or its config.json as a dict with model_type), or a torchtitan "
            "model config (e.g. DeepSeekV3Model.Config)"
        )
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    bias = bool(experts and getattr(config, "moe_router_enable_expert_bias", False))
    aux = "megatron" if experts else None
    return ModelFacts(experts, int(config.num_layers), ep, aux, expert_bias=bias)


def _no_router_message(facts: ModelFacts) -> str:
    """The warning for a model whose config has experts but whose modules hold no known router."""
    register = (
        "For a custom router class call nemo_moe_metrics.register_router(RouterClass, "
        "counts_fn) before attach()."
    )
    if facts.source == "hf":
        return (
            f"PolicyMetrics.attach: the config ({facts.model_type}) says {facts.num_experts} "
            "experts but the model has no module that follows transformers' experts interface "
            "(experts(hidden_states, top_k_index, top_k_weights)) or a MoE block this library "
            "knows, so no expert loads are counted (docs/en/models.md: adding a family). "
            f"{register}"
        )
    return (
        f"PolicyMetrics.attach: the config says {facts.num_experts} experts but no known "
        "MoE router was found in the model, so no expert loads are counted on this rank "
        f"(expected only on a pipeline stage without MoE layers). {register}"
    )


def _num_sequences(seq_lens: Any) -> int | None:
    """How many sequences ``seq_lens`` describes (a shape, never a value read)."""
    if isinstance(seq_lens, torch.Tensor):
        return int(seq_lens.shape[0]) if seq_lens.dim() == 1 else None
    return len(seq_lens) if isinstance(seq_lens, list | tuple) else None


_INPUT_KEYS = ("input_ids", "tokens", "inputs_embeds", "input")


def _input_rows_and_width(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """``(sequences, positions per sequence)`` of a model's token input, from its shape."""
    found = next((kwargs[k] for k in _INPUT_KEYS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if found is None and args and isinstance(args[0], torch.Tensor):
        found = args[0]
    if found is None or found.dim() < 2 or found.is_floating_point() and found.dim() < 3:
        return None  # no [batch, seq] token ids (or [batch, seq, hidden] embeddings) to read
    return int(found.shape[0]), int(found.shape[1])


def _context_parallel_size() -> int:
    ps = sys.modules.get("megatron.core.parallel_state")  # only if in use
    if ps is None or not ps.model_parallel_is_initialized():
        return 1
    return int(ps.get_context_parallel_world_size())


def _check_tokens_against_routers(out: dict[str, Any]) -> None:
    # Both numbers are already reduced over the ranks (the same on every rank): the real tokens
    # seq_lens claims cannot exceed the tokens the MoE routers saw (padding included or not).
    tokens, routed = out.get(mn.TOKENS), out.get(mn.ROUTED_TOKENS)
    if tokens is None or not routed or tokens <= routed:
        return
    raise ValueError(
        f"PolicyMetrics.finish_step: microbatch(seq_lens=...) adds up to {tokens:,.0f} tokens "
        f"this step, but the MoE routers saw only {routed:,.0f} ({mn.ROUTED_TOKENS}), so "
        f"{mn.TOKENS} and the FLOPs would be {tokens / routed:.3g}x too high. seq_lens holds "
        "one count per sequence of the microbatch: its real (non-padding) tokens, e.g. "
        "attention_mask.sum(-1) or lengths_from_cu_seqlens(cu_seqlens)"
    )


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
        self._input_hooks: list[Any] = []
        self._facts: ModelFacts | None = None
        self._hf_aux: Any = None  # moe.hf_aux_loss.HFAuxLossAccumulator for transformers models
        self._bias: Any = None  # moe.expert_bias.ExpertBiasTracker when routers keep a bias
        self._routing: Any = None  # moe.routing.RoutingTracker (this rank's routers) or None
        self._routing_reducer: Any = None  # moe.reduction.RoutingReducer, every rank
        self._health: Any = None  # moe.router_health.RouterHealthTracker (this rank's routers)
        self._health_reducer: Any = None  # moe.reduction.RouterHealthReducer, every rank
        self._routes_ignored = False  # warned once that routes came with the flag off
        self._steps_since_export = 0
        # microbatch() calls since the last export and when the open step began: host
        # counters (no device read per microbatch), checked against finish_step's count.
        self._microbatches_since_export = 0
        self._microbatches_at_step_start = 0
        # len(seq_lens) of the last microbatch() call until a training forward of a chunk
        # shows the batch it was for (throughput only; see _note_model_input).
        self._lengths_awaiting_forward: int | None = None
        self._warned_empty_step = False
        self._aux_kept: dict[str, torch.Tensor] = {}  # megatron's tracker as step() left it
        self._in_step = False  # inside `with metrics.step():`; errors name the public calls
        # megatron's aux-loss tracker as it was when the open step began (device copies):
        # restart_step() puts it back; in shared mode it shows whether anything cleared it.
        self._tracker_at_step_start: dict[str, torch.Tensor] | None = None
        self._warned_uncleared_tracker = False

    @property
    def active(self) -> bool:
        """Whether anything is measured (False: every call is a no-op)."""
        return self._track_moe or self._meter is not None

    def attach(self, model: nn.Module | list[nn.Module], config: Any) -> None:
        """Hook the model chunks as the flags say; nothing at all when they are off or not MoE.

        ``config`` is the model's megatron-core ``TransformerConfig`` or its transformers
        ``PretrainedConfig`` (``model.config``); its type picks the adapter (:func:`model_facts`).
        For megatron the model decides: a hybrid model's own layer pattern counts even when the
        config lacks it (``megatron.layout.config_as_built``); a config that contradicts the
        model is an error.
        """
        if self._attached:
            raise RuntimeError("PolicyMetrics.attach() was already called; attach once per model")
        self._attached = True
        chunks = model if isinstance(model, list | tuple) else [model]
        from nemo_moe_metrics.flops.megatron import is_megatron_config

        if is_megatron_config(config):
            # The model decides: a hybrid model's pattern and the layers that hold routers.
            from nemo_moe_metrics.megatron.layout import config_as_built

            config = config_as_built(chunks, config)
        self._transformer_config = config
        self._facts = model_facts(config)
        if self.cfg.track_moe_metrics:
            self._attach_moe(chunks, self._facts)
        if self.cfg.track_throughput:
            self._meter = self._build_meter(config, chunks[0] if len(chunks) == 1 else None)
            self._input_hooks = [
                chunk.register_forward_pre_hook(self._note_model_input, with_kwargs=True)
                for chunk in chunks
            ]

    def _attach_moe(self, chunks: list[nn.Module], facts: ModelFacts) -> None:
        from nemo_moe_metrics.moe.hooks import ExpertLoadCollector
        from nemo_moe_metrics.moe.reduction import ExpertLoadReducer

        # megatron decides from the config, not from this rank's modules: a pipeline stage
        # without MoE layers must still join every collective the other stages make. Hugging
        # Face and torchtitan models are whole on every rank: their modules decide.
        collector = None
        if facts.num_experts or facts.source != "megatron":
            collector = ExpertLoadCollector.attach(chunks, num_layers=facts.num_layers or None)
        if not facts.num_experts and collector is None:
            log.warning(
                "track_moe_metrics is on but the model has no MoE layers: no moe/ metrics, no hooks"
            )
            return
        self._track_moe = True
        self._collector = collector
        if self._collector is not None:
            self._collector.counting = False  # only inside step()
        self._reducer = ExpertLoadReducer(None)
        self._ep_size = facts.ep_size
        if self._collector is None:
            warnings.warn(_no_router_message(facts), RuntimeWarning, stacklevel=3)
        if facts.expert_bias:
            from nemo_moe_metrics.moe.expert_bias import ExpertBiasTracker

            # Every rank joins the bias reduce, also a pipeline stage without MoE layers.
            sources = self._collector.expert_bias_sources() if self._collector else []
            self._bias = ExpertBiasTracker(sources)
        if self.cfg.track_router_health:
            from nemo_moe_metrics.moe.reduction import RouterHealthReducer

            if self._collector is not None:
                self._health = self._collector.enable_health(self.cfg.router_near_tie_gap)
            self._health_reducer = RouterHealthReducer(None)
        if self.cfg.track_routing_consistency:
            self._attach_routing(facts)
        if facts.source == "hf" and self._collector is not None:
            self._attach_hf_aux_loss(chunks)

    def _attach_hf_aux_loss(self, chunks: list[nn.Module]) -> None:
        # The loss the model's own training computes (transformers' load_balancing_loss_func),
        # per layer, from the router logits the model records as router_logits.
        from nemo_moe_metrics.moe import hf_models
        from nemo_moe_metrics.moe.hf_aux_loss import HFAuxLossAccumulator

        kind = hf_models.aux_loss_kind(chunks)
        collector = self._collector
        sources = hf_models.router_logit_sources(chunks, collector.blocks) if kind else []
        if not sources:
            return
        layers = collector.layer_ids
        experts = dict(zip(layers, collector.num_experts, strict=True))
        topks = dict(zip(layers, collector.topks, strict=True))
        size = max(self._facts.num_layers, max(layers) + 1)
        self._hf_aux = HFAuxLossAccumulator(size, [layer for layer, _, _ in sources], kind)
        for layer, router, index in sources:
            observe = self._hf_aux.observer(index, experts[layer], topks[layer])
            collector.observe_module(router, layer, observe)

    def _attach_routing(self, facts: ModelFacts) -> None:
        from nemo_moe_metrics.moe.reduction import RoutingReducer

        config = self._transformer_config
        if facts.aux_loss == "megatron" or hasattr(config, "num_moe_experts"):
            from nemo_moe_metrics.moe.aux_loss import moe_layer_indices

            # Decoder MoE layers only: engines return routes for the decoder's routers.
            moe_layers = [i for i in moe_layer_indices(config) if i < int(config.num_layers)]
            topk = int(config.moe_router_topk)
        else:
            if self._collector is None:
                return
            moe_layers, topk = self._collector.layer_ids, self._collector.topk
        # With router health, the rollout engine's own load too (moe/rollout_max_over_ideal).
        rollout_experts = facts.num_experts if self.cfg.track_router_health else 0
        if self._collector is not None:
            self._routing = self._collector.enable_routing(
                moe_layers, rollout_experts=rollout_experts
            )
        self._routing_reducer = RoutingReducer(moe_layers, topk, rollout_experts=rollout_experts)

    def _build_meter(self, transformer_config: Any, model: nn.Module | None = None) -> Any:
        from nemo_moe_metrics.throughput import StepMeter

        estimator, peak = None, None
        if self.cfg.track_flops:
            from nemo_moe_metrics.flops import resolve_peak_flops, try_get_flops_estimator

            # Unknown model type: one warning and no FLOP keys, never a reported 0. A
            # transformers model without a formula is read from its own modules, once here.
            estimator = try_get_flops_estimator(
                transformer_config, vocab_size=self.vocab_size, model=model
            )
            device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            if estimator is not None:
                peak = resolve_peak_flops(device_name, self.cfg.peak_flops_per_gpu)
        data_group = None  # world: every rank a data-parallel replica (DDP, FSDP)
        parallel_state = sys.modules.get("megatron.core.parallel_state")  # only if in use
        ps = parallel_state
        if dist.is_initialized() and ps is not None and ps.model_parallel_is_initialized():
            data_group = ps.get_data_parallel_group(with_context_parallel=False)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        host_timing_group = None
        if device is not None and dist.is_initialized() and dist.get_backend() != "gloo":
            # CUDA events: the step seconds' MAX goes host to host, so the export waits once.
            # Creating a group is collective: every rank attaches with the same flags.
            host_timing_group = dist.new_group(backend="gloo")
        return StepMeter(
            flops_estimator=estimator,
            peak_flops_per_gpu=peak,
            device=device,
            data_group=data_group,
            host_timing_group=host_timing_group,
        )

    def resume_totals(
        self, total_tokens: float, total_seconds: float, total_flops: float = 0.0
    ) -> None:
        """Continue ``train_perf/total_*`` and the cumulative rates of a resumed run (after
        ``attach``, before the first step); a no-op without throughput tracking."""
        if self._meter is not None:
            self._meter.resume(total_tokens, total_seconds, total_flops)

    @property
    def _megatron_aux(self) -> bool:
        facts = self._facts
        return (
            self._track_moe
            and self._hf_aux is None
            and facts is not None
            and facts.aux_loss == "megatron"
        )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Bracket one optimizer step; a step that raises leaves no partial counts behind.

        Only training forwards inside it are counted (expert loads, aux losses): what a forward
        with grad outside ``step()`` added to megatron's aux-loss tracker is undone on entry.
        """
        self._require_attach("step")
        if self._in_step:
            raise RuntimeError(
                "PolicyMetrics.step() is already open: steps do not nest; leave the previous "
                "`with metrics.step():` block before starting the next step"
            )
        self._in_step = True
        self._microbatches_at_step_start = self._microbatches_since_export
        self._lengths_awaiting_forward = None
        self._enter_counting()
        try:
            if self._meter is not None:
                with self._meter.step():
                    yield
            else:
                yield
        except BaseException:
            self._discard_partial_step()
            self._microbatches_since_export = self._microbatches_at_step_start
            raise
        finally:
            self._in_step = False
            self._leave_counting()
        self._steps_since_export += 1

    def _enter_counting(self) -> None:
        if self._megatron_aux:
            from nemo_moe_metrics.moe.aux_loss import restore_tracker, tracker_snapshot

            if self.cfg.aux_loss_tracker == "own":
                # The tracker as the previous steps of this export left it (empty after an
                # export): anything more came from forwards outside step(). Shared mode leaves
                # the tracker to the framework. Device ops only, no host read.
                restore_tracker(self._aux_kept)
            self._tracker_at_step_start = tracker_snapshot()  # for restart_step()
        if self._collector is not None:
            self._collector.counting = True

    def _leave_counting(self) -> None:
        if self._collector is not None:
            self._collector.counting = False
        if self._megatron_aux:
            from nemo_moe_metrics.moe.aux_loss import tracker_snapshot

            self._aux_kept = tracker_snapshot()

    def _discard_partial_step(self) -> None:
        self._aux_kept = {}
        if self._collector is not None:
            self._collector.reset()
        if self._hf_aux is not None:
            self._hf_aux.reset()
        elif self._track_moe and self.cfg.aux_loss_tracker == "own":
            # shared: the tracker is the framework's; its own report decides what to do.
            from nemo_moe_metrics.moe.aux_loss import clear_aux_loss_tracker

            clear_aux_loss_tracker()

    def restart_step(self) -> None:
        """Forget what the open step counted so far, because its forward-backward runs again.

        Megatron's rerun state machine (``should_run_forward_backward``) can run a step's
        forward-backward twice; call this before the second run, so expert counts, tokens and
        aux losses come from the run the optimizer applies, once. Megatron's aux-loss tracker is
        put back to where it stood when the step began (in shared mode too: then the
        framework's own report counts the step once as well). Expert counts restart from zero:
        export once per step (``finish_step`` after every ``step()``) when you use this.
        """
        if self._collector is not None:
            self._collector.reset()
        if self._hf_aux is not None:
            self._hf_aux.reset()
        if self._tracker_at_step_start is not None:
            from nemo_moe_metrics.moe.aux_loss import restore_tracker

            restore_tracker(self._tracker_at_step_start)
        if self._meter is not None:
            self._meter.discard_step_sequences()
        self._microbatches_since_export = self._microbatches_at_step_start
        self._lengths_awaiting_forward = None

    def microbatch(
        self, seq_lens: torch.Tensor, rollout_routes: torch.Tensor | None = None
    ) -> None:
        """Record one training microbatch; ``seq_lens``: see the module docstring (one per sequence).

        ``rollout_routes`` (with ``track_routing_consistency``): the experts the rollout engine
        chose for this microbatch's tokens, ``[tokens, moe_layers, top_k]`` in the model's token
        order (packed sequences concatenated) or padded ``[batch, seq, moe_layers, top_k]``;
        ``-1`` where no route was captured. Shapes are checked here (a mismatch raises before
        any collective); no value is read on the host. Call it inside ``with metrics.step():``,
        before the microbatch's forward.
        """
        self._require_attach("microbatch")
        if not self._in_step:
            raise RuntimeError(
                "PolicyMetrics.microbatch() called outside a step; call it once per training "
                "microbatch inside `with metrics.step():` (before the microbatch's forward), "
                "then finish_step() after the block"
            )
        if self._routing is not None:
            n = _num_sequences(seq_lens)
            self._routing.set_routes(rollout_routes, num_sequences=n)
        elif (
            self._routing_reducer is None
            and rollout_routes is not None
            and not self._routes_ignored
        ):
            self._routes_ignored = True
            warnings.warn(
                "PolicyMetrics.microbatch: rollout_routes are ignored because "
                "track_routing_consistency is off (set it, with track_moe_metrics, to log "
                "moe/routing_*)",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._meter is not None:
            self._meter.add_sequences(seq_lens)
            self._lengths_awaiting_forward = _num_sequences(seq_lens)
        self._microbatches_since_export += 1

    def _note_model_input(self, chunk: nn.Module, args: tuple, kwargs: dict) -> None:
        # The first training forward of a chunk after microbatch() shows the batch the lengths
        # were for: its input's shape (metadata only, no host read). One length per row; a
        # single row ([1, total], THD packing) holds any number of packed sequences.
        if not (self._in_step and chunk.training and torch.is_grad_enabled()):
            return  # a no-grad or eval forward (reference scoring) is not the microbatch's
        count, self._lengths_awaiting_forward = self._lengths_awaiting_forward, None
        if count is None:
            return
        rows_and_width = _input_rows_and_width(args, kwargs)
        if rows_and_width is None:  # e.g. a middle pipeline stage (no token input)
            return
        rows, width = rows_and_width
        if _context_parallel_size() == 1:  # a CP rank's input holds part of each sequence
            self._meter.note_positions(rows * width)
        if count != rows and rows > 1:
            self._meter.reject(
                f"microbatch(seq_lens=...) got {count} length(s) but the model's next forward "
                f"took a batch of {rows} sequences ({rows} x {width}); pass one real-token "
                "count per sequence of that batch, e.g. attention_mask.sum(-1) (sequences "
                "packed into one row, [1, total], pass one length per packed sequence)"
            )

    def finish_step(self, num_microbatches: int) -> dict[str, Any]:
        """Reduce across ranks and return the step's metrics; collective, same dict on every rank.

        Any error keeps its type and gains a note naming the export and the likely cause, so a
        collective timeout or a closed connection (a rank that failed earlier) reads as such.
        Misuse that every rank makes alike (no ``attach``, no step since the last export, a
        ``num_microbatches`` that is not the number of ``microbatch()`` calls) raises before any
        collective.
        """
        self._check_finish_call(num_microbatches)
        try:
            return self._finish_step(num_microbatches)
        except ValueError:
            raise  # bad input, found on every rank alike: its message says what to fix
        except Exception as err:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            err.add_note(
                f"nemo_moe_metrics: PolicyMetrics.finish_step failed on rank {rank} during the "
                "metrics export, a collective every rank must join after each step. A timeout or "
                "'Connection closed by peer' here means another rank failed earlier or skipped "
                "finish_step: look for the first error in the other ranks' logs."
            )
            raise

    def _require_attach(self, call: str) -> None:
        if not self._attached:
            raise RuntimeError(
                f"PolicyMetrics.{call}() before attach(): call metrics.attach(model, config) "
                "once after building the model, before the first step (without it nothing is "
                "measured and every step would return {})"
            )

    def _check_finish_call(self, num_microbatches: int) -> None:
        self._require_attach("finish_step")
        if self._in_step:
            raise RuntimeError(
                "PolicyMetrics.finish_step() inside `with metrics.step():`; call it after the "
                "block ends (after optimizer.step()), on every rank"
            )
        if not self._steps_since_export:
            raise RuntimeError(
                "PolicyMetrics.finish_step() without a step: no `with metrics.step():` block "
                "ended since the last finish_step (finish_step called twice, or the step's "
                "forward-backward ran outside `with metrics.step():`); wrap each optimizer "
                "step in `with metrics.step():` and call finish_step once after it"
            )
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(
                f"PolicyMetrics.finish_step(num_microbatches={num_microbatches!r}): pass the "
                "number of microbatches the step(s) since the last finish_step ran, an int >= 1"
            )
        calls = self._microbatches_since_export
        if calls and calls != num_microbatches:
            raise ValueError(
                f"PolicyMetrics.finish_step(num_microbatches={num_microbatches}) but "
                f"microbatch() was called {calls} time(s) since the last finish_step: the aux "
                f"losses are divided by num_microbatches, so they would be {calls}/"
                f"{num_microbatches} of their value. Pass the number of microbatches this "
                "step ran (the schedule's num_microbatches), and call microbatch() once per "
                "microbatch (once per microbatch also under virtual pipeline stages). A rank "
                "that calls microbatch() for no microbatch (a pipeline stage without the batch) "
                "is not checked."
            )

    def _finish_step(self, num_microbatches: int) -> dict[str, Any]:
        # Every family launches its device work and collectives (same order on every rank),
        # then ONE host read brings all results back and each family finishes on host numbers.
        # A new family joins by appending its Pending here.
        pending = []
        if self._track_moe:
            from nemo_moe_metrics.moe.balance import expert_load_metrics

            pending.append(self._enqueue_aux_loss(num_microbatches))
            loads = self._reducer.enqueue(self._collector)
            pending.append(
                loads.then(
                    lambda result: expert_load_metrics(
                        result,
                        per_layer=self.cfg.moe_per_layer_logging,
                        table=self.cfg.log_expert_table,
                        ep_size=self._ep_size,
                    )
                )
            )
            if self._bias is not None:  # after the loads: their first export agrees the layers
                from nemo_moe_metrics.moe.expert_bias import split_layer_keys

                per_layer = self.cfg.moe_per_layer_logging
                pending.append(
                    self._bias.enqueue(self._reducer.layer_ids).then(
                        lambda bias: split_layer_keys(bias, per_layer)
                    )
                )
            if self._health_reducer is not None:  # after the loads, like the bias
                from nemo_moe_metrics.moe.reduction import default_contribute

                pending.append(
                    self._health_reducer.enqueue(
                        self._health,
                        self._reducer.layer_ids,
                        self._reducer.topks,
                        per_layer=self.cfg.moe_per_layer_logging,
                        contribute=default_contribute(self._collector),
                    )
                )
        if self._routing_reducer is not None:
            from nemo_moe_metrics.moe.reduction import default_contribute

            pending.append(
                self._routing_reducer.enqueue(
                    self._routing,
                    per_layer=self.cfg.moe_per_layer_logging,
                    contribute=default_contribute(self._collector),
                )
            )
        if self._meter is not None:
            pending.append(self._meter.enqueue())
        if self._megatron_aux and self.cfg.aux_loss_tracker == "shared":
            pending.append(self._enqueue_uncleared_tracker_check())
        out: dict[str, Any] = {}
        try:
            for metrics in read_once(pending):
                out.update(metrics)
            if out.get(mn.ROUTED_TOKENS) == 0:
                self._drop_empty_moe_step(out)
            if self._collector is None or self._collector.routes_every_token:
                _check_tokens_against_routers(out)
            if self._meter is not None:
                self._check_microbatches_recorded(out)
        finally:
            # The families consumed the interval at enqueue: an export that raises (bad input,
            # found on every rank alike) discards it, and the next step starts afresh.
            self._steps_since_export = 0
            self._microbatches_since_export = 0
            self._aux_kept = {}
            self._tracker_at_step_start = None
        return out

    def _drop_empty_moe_step(self, out: dict[str, Any]) -> None:
        # No expert received a training token: balance statistics and aux losses of nothing
        # would be zeros that contradict themselves (dead_experts 0 with every expert empty).
        for key in [k for k in out if k.startswith(mn.MOE_PREFIX) and k != mn.ROUTED_TOKENS]:
            del out[key]
        if not self._warned_empty_step:
            self._warned_empty_step = True
            log.warning(
                "PolicyMetrics.finish_step: no expert received a training token in this step "
                "(only no-grad or eval forwards, or none inside `with metrics.step():`), so it "
                "logs %s = 0 and no other moe/ key; warned once",
                mn.ROUTED_TOKENS,
            )

    def _enqueue_uncleared_tracker_check(self) -> Pending[dict[str, Any]]:
        # Shared mode: the framework's report clears megatron's tracker after finish_step. If the
        # tracker held anything when this step began, nothing did, and values pile up over steps.
        start = self._tracker_at_step_start
        if self._warned_uncleared_tracker or not start:
            return done({})
        total = torch.stack([v.detach().float().abs().sum() for v in start.values()]).sum()

        def finish(host: list[Any]) -> dict[str, Any]:
            held = float(host[0].reshape(-1)[0])
            if held != 0.0 and not self._warned_uncleared_tracker:
                self._warned_uncleared_tracker = True
                warnings.warn(
                    f"aux_loss_tracker: shared, but megatron's aux-loss tracker still held values "
                    f"(sum {held:.4g}) when this step began: nothing cleared it after the previous "
                    "step, so megatron's and our moe/ aux losses add up over steps. Call "
                    "megatron's report after finish_step every step (track_moe_metrics on "
                    "megatron-core 0.16, get_moe_metrics_tracker().report on 0.19, as the "
                    "training_log of Megatron-Bridge and Megatron-LM does), or set "
                    "aux_loss_tracker: own to let nemo_moe_metrics clear it.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return {}

        return Pending((total.reshape(1),), finish)

    def _enqueue_aux_loss(self, num_microbatches: int) -> Pending[dict[str, float]]:
        # One source per config type: megatron's tracker, or the HF router-output accumulator.
        if self._hf_aux is not None:
            from nemo_moe_metrics.moe.hf_aux_loss import enqueue_hf_aux_loss_metrics

            return enqueue_hf_aux_loss_metrics(
                self._hf_aux,
                self._hf_aux.layers,
                num_microbatches=num_microbatches,
                per_layer=self.cfg.moe_per_layer_logging,
            )
        if self._facts is not None and self._facts.aux_loss != "megatron":
            return done({})
        from nemo_moe_metrics.moe.aux_loss import enqueue_aux_loss_metrics

        return enqueue_aux_loss_metrics(
            self._transformer_config,
            num_microbatches=num_microbatches,
            per_layer=self.cfg.moe_per_layer_logging,
            tracker=self.cfg.aux_loss_tracker,
        )

    def _check_microbatches_recorded(self, perf: dict[str, Any]) -> None:
        # perf holds the tokens already reduced over every rank (read at export anyway), so
        # every rank takes this branch together; only then one more tiny collective asks
        # whether any rank called microbatch() (zero-length sequences are a valid 0 tokens).
        if not self._steps_since_export or perf.get(mn.TOKENS) != 0:
            return
        calls = self._microbatches_since_export
        if dist.is_available() and dist.is_initialized():
            device = "cpu" if str(dist.get_backend()) == "gloo" else "cuda"
            total = torch.tensor([calls], dtype=torch.int64, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            calls = int(total.item())
        if calls == 0:
            raise RuntimeError(
                "PolicyMetrics.finish_step: track_throughput is on but no rank called "
                "microbatch() since the last finish_step, so train_perf/ would report 0 tokens. "
                "Call metrics.microbatch(seq_lens=...) once per microbatch inside "
                "`with metrics.step():` (e.g. in forward_step_func)."
            )

    def detach(self) -> None:
        """Remove every hook (the model runs exactly as before)."""
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks = []
        if self._collector is not None:
            self._collector.detach()
            self._collector = None
