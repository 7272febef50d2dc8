"""PolicyMetrics: the five calls a training worker (or a framework) makes to get its metrics.

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
``nemo_moe_metrics.export.metric_names``; loops merge it as is (no extra prefix). What is measured
is a list of metric families built at ``attach`` from one registration list
(``nemo_moe_metrics.families.REGISTERED``); this facade calls them at the same points of every
step and knows none of them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics import families
from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily
from nemo_moe_metrics.adapters.registry import attach_collector, family_of, model_facts
from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import read_once
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.generation_mask import EndOfSequence

log = logging.getLogger(__name__)

__all__ = ["ModelFacts", "PolicyMetrics", "model_facts"]

M = TypeVar("M", bound=MetricFamily)


#: transformers' encoder-decoder MoE families: their routers predate the experts interface and
#: route in both stacks; not supported (the warning says so).
ENCODER_DECODER_MOE = ("switch_transformers", "nllb-moe", "nllb_moe")


def _no_router_message(facts: ModelFacts) -> str:
    """The warning for a model whose config has experts but whose modules hold no known router."""
    register = (
        "For a custom router class call nemo_moe_metrics.register_router(RouterClass, "
        "counts_fn) before attach()."
    )
    if facts.source == "hf" and facts.model_type in ENCODER_DECODER_MOE:
        return (
            f"PolicyMetrics.attach: {facts.model_type} is an encoder-decoder MoE model; only "
            "decoder-only (and vision-language) MoE families are supported (docs/en/models.md), "
            "so no expert loads are counted"
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
    """Attaches what the metric flags ask for to a model and turns each step into metrics.

    Not thread-safe: one thread drives a ``PolicyMetrics`` (one per model and process).
    """

    def __init__(self, cfg: MetricsConfig, *, vocab_size: int | None = None) -> None:
        """``vocab_size`` sizes the lm_head in the FLOP estimate (megatron configs lack it)."""
        self.cfg = cfg
        self.vocab_size = vocab_size
        self._families: list[MetricFamily] = []
        self._collector: ExpertLoadCollector | None = None  # the router hooks, when MoE
        self._attached = False
        self._facts: ModelFacts | None = None
        self._family: ModelFamily | None = None
        self._routes_ignored = False  # warned once that routes came with the flag off
        self._steps_since_export = 0
        # microbatch() calls since the last export and when the open step began: host
        # counters (no device read per microbatch), checked against finish_step's count.
        self._microbatches_since_export = 0
        self._microbatches_at_step_start = 0
        self._warned_empty_step = False
        self._in_step = False  # inside `with metrics.step():`; errors name the public calls

    @property
    def active(self) -> bool:
        """Whether anything is measured (False: every call is a no-op)."""
        return bool(self._families)

    @property
    def facts(self) -> ModelFacts | None:
        """What :meth:`attach` read from the model's config (None before it): experts, layers,
        top-k, expert-parallel size; integrations give it to ``open_run`` for ``run.json``."""
        return self._facts

    def family(self, kind: type[M]) -> M | None:
        """The attached metric family of class ``kind`` (``nemo_moe_metrics.families``), or
        None (its flag is off, or the model leaves it out)."""
        return next((f for f in self._families if isinstance(f, kind)), None)

    def attach(self, model: nn.Module | list[nn.Module], config: Any) -> None:
        """Hook the model chunks as the flags say; nothing at all when they are off or not MoE.

        ``config`` is the model's megatron-core ``TransformerConfig``, its transformers
        ``PretrainedConfig`` (``model.config``) or a torchtitan model config; its type picks
        the model family (``adapters.registry.family_of``). The model decides what the config
        leaves open or contradicts (``ModelFamily.as_built``): a hybrid megatron model's own
        layer pattern counts even when the config lacks it; a transformers config that
        contradicts the model is an error.
        """
        if self._attached:
            raise RuntimeError("PolicyMetrics.attach() was already called; attach once per model")
        self._attached = True
        chunks = model if isinstance(model, list | tuple) else [model]
        self._family = family_of(config)
        config = self._family.as_built(chunks, config)
        self._facts = self._family.facts(config)
        moe = self.cfg.track_moe_metrics and self._attach_collector(chunks, self._facts)
        context = BuildContext(
            cfg=self.cfg,
            model_family=self._family,
            facts=self._facts,
            config=config,
            chunks=chunks,
            vocab_size=self.vocab_size,
            collector=self._collector,
            moe=moe,
        )
        # One loop over the registration list, in its order (the export's); the list is
        # ours from the start, so detach() undoes what a build that raised left hooked.
        self._families = context.built
        for build in families.REGISTERED:
            family = build(context)
            if family is not None:
                context.built.append(family)

    def _attach_collector(self, chunks: list[nn.Module], facts: ModelFacts) -> bool:
        """Hook the routers; whether the MoE families apply (MoE layers on some rank)."""
        # megatron decides from the config, not from this rank's modules: a pipeline stage
        # without MoE layers must still join every collective the other stages make. Hugging
        # Face and torchtitan models are whole on every rank: their modules decide.
        collector = None
        if facts.num_experts or self._family.whole_on_every_rank:
            collector = attach_collector(chunks, num_layers=facts.num_layers or None)
        if not facts.num_experts and collector is None:
            log.warning(
                "track_moe_metrics is on but the model has no MoE layers: no moe/ metrics, no hooks"
            )
            return False
        if collector is None:
            warnings.warn(_no_router_message(facts), RuntimeWarning, stacklevel=3)
        self._collector = collector
        return True

    def resume_totals(
        self,
        total_tokens: float,
        total_seconds: float,
        total_flops: float = 0.0,
        *,
        restart: bool = False,
    ) -> None:
        """Continue ``train_perf/total_*`` and the cumulative rates of a resumed run (after
        ``attach``, before the first step; ``restart=True``: also after steps, when training
        went back to a checkpoint); a no-op without throughput tracking."""
        for family in self._families:
            family.resume(total_tokens, total_seconds, total_flops, restart)

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
                "`with metrics.step():` block before starting the next step. (A PolicyMetrics "
                "is not thread-safe: one thread drives it; give each model its own.)"
            )
        self._in_step = True
        self._microbatches_at_step_start = self._microbatches_since_export
        for family in self._families:
            family.enter_step()
        try:
            with contextlib.ExitStack() as around:
                for family in self._families:
                    around.enter_context(family.around_step())
                yield
        except BaseException:
            for family in self._families:
                family.discard()
            self._microbatches_since_export = self._microbatches_at_step_start
            raise
        finally:
            self._in_step = False
            for family in self._families:
                family.leave_step()
        self._steps_since_export += 1

    @contextlib.contextmanager
    def generation(self, eos_token_ids: Sequence[int] | None = None) -> Iterator[None]:
        """Bracket a generation by the policy model itself (a rollout inside the training loop,
        such as TRL's GRPO calling ``model.generate``).

        Its forwards (prefill and every decode step, real tokens only) count as the rollout's
        expert load, logged at the next ``finish_step`` as ``moe/rollout_max_over_ideal`` (per
        layer ``moe/layer_{i}/rollout_max_over_ideal`` with ``moe_per_layer_logging``); they
        never enter the training counts. The export of the rollout load is collective: every
        rank generates at the same steps. Hugging Face and torchtitan models only.

        ``eos_token_ids`` (one ``generate`` call per block): positions after a sequence's first
        end-of-sequence token are not counted either (``generate`` feeds them padding with
        attention mask 1 until the last sequence ends; :mod:`nemo_moe_metrics.moe.generation_mask`).
        """
        self._require_attach("generation")
        collector = self._collector
        if collector is None:
            yield
            return
        collector.rollout_counting = True
        collector.end_of_sequence = EndOfSequence(eos_token_ids) if eos_token_ids else None
        try:
            yield
        finally:
            collector.rollout_counting = False
            collector.end_of_sequence = None

    def restart_step(self) -> None:
        """Forget what the open step counted so far, because its forward-backward runs again.

        Megatron's rerun state machine (``should_run_forward_backward``) can run a step's
        forward-backward twice; call this before the second run, so expert counts, tokens and
        aux losses come from the run the optimizer applies, once. Megatron's aux-loss tracker is
        put back to where it stood when the step began (in shared mode too: then the
        framework's own report counts the step once as well). Expert counts restart from zero:
        export once per step (``finish_step`` after every ``step()``) when you use this.
        """
        for family in self._families:
            family.restart()
        self._microbatches_since_export = self._microbatches_at_step_start

    def microbatch(
        self, seq_lens: torch.Tensor, rollout_routes: torch.Tensor | None = None
    ) -> None:
        """Record one training microbatch; ``seq_lens``: see the module docstring (one per
        sequence).

        ``rollout_routes`` (with ``track_routing_consistency``): the experts the rollout engine
        chose for this microbatch's tokens, ``[tokens, moe_layers, top_k]`` in the model's token
        order (packed sequences concatenated) or padded ``[batch, seq, moe_layers, top_k]``;
        ``-1`` where no route was captured. Shapes are checked here (a mismatch raises before
        any collective); no value is read on the host. The routes are read, not copied, by the
        step's comparison at :meth:`finish_step`: leave them unchanged until then (an in-place
        write is an error there). Call it inside ``with metrics.step():``, before the
        microbatch's forward.
        """
        self._require_attach("microbatch")
        if not self._in_step:
            raise RuntimeError(
                "PolicyMetrics.microbatch() called outside a step; call it once per training "
                "microbatch inside `with metrics.step():` (before the microbatch's forward), "
                "then finish_step() after the block"
            )
        takes_routes = any(family.takes_rollout_routes for family in self._families)
        if rollout_routes is not None and not takes_routes and not self._routes_ignored:
            self._routes_ignored = True
            warnings.warn(
                "PolicyMetrics.microbatch: rollout_routes are ignored because "
                "track_routing_consistency is off (set it, with track_moe_metrics, to log "
                "moe/routing_*)",
                RuntimeWarning,
                stacklevel=2,
            )
        sequences = _num_sequences(seq_lens)
        for family in self._families:
            family.microbatch(seq_lens, rollout_routes, sequences)
        self._microbatches_since_export += 1

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
        # then ONE host read brings all results back and each family checks host numbers.
        pending = [p for family in self._families for p in family.enqueue(num_microbatches)]
        out: dict[str, Any] = {}
        try:
            for metrics in read_once(pending):
                out.update(metrics)
            if out.get(mn.ROUTED_TOKENS) == 0:
                self._drop_empty_moe_step(out)
            collector = self._collector
            if collector is None or collector.routes_every_token:
                _check_tokens_against_routers(out)
            for family in self._families:
                family.check(out, self._microbatches_since_export)
            for family in self._families:
                family.complete(out)
        finally:
            # The families consumed the interval at enqueue: an export that raises (bad input,
            # found on every rank alike) discards it, and the next step starts afresh.
            self._steps_since_export = 0
            self._microbatches_since_export = 0
            for family in self._families:
                family.end_export()
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

    def detach(self) -> None:
        """Remove every hook (the model runs exactly as before)."""
        for family in self._families:
            family.detach()
        self._collector = None
