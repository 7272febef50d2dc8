"""The router aux losses: megatron-core's layer-wise tracker, or a model's own loss.

``moe/load_balancing_loss``, ``moe/z_loss`` and the others (docs/en/aux_loss.md): a megatron
model's come from megatron's aux-loss tracker, read with megatron's semantics
(:class:`MegatronAuxLoss`); a transformers model that trains with its own load-balancing loss
gets that loss recomputed per layer from the router logits it records (:class:`ModelAuxLoss`).
A model has one or the other, so one ``build`` picks.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export.host_read import Pending, done
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.moe import aux_loss
from nemo_moe_metrics.moe.hf_aux_loss import HFAuxLossAccumulator, enqueue_hf_aux_loss_metrics


class MegatronAuxLoss(MetricFamily):
    """megatron-core's layer-wise aux-loss tracker, read with megatron's semantics."""

    def __init__(self, transformer_config: Any, cfg: MetricsConfig) -> None:
        """``cfg.aux_loss_tracker``: ``own`` (we clear the tracker) or ``shared``."""
        self.config = transformer_config
        self.cfg = cfg
        self.own = cfg.aux_loss_tracker == "own"
        self._kept: dict[str, torch.Tensor] = {}  # the tracker as step() left it
        # The tracker as it was when the open step began (device copies): restart() puts it
        # back; in shared mode it shows whether anything cleared it.
        self._at_step_start: dict[str, torch.Tensor] | None = None
        self._warned_uncleared = False

    def enter_step(self) -> None:
        if self.own:
            # The tracker as the previous steps of this export left it (empty after an
            # export): anything more came from forwards outside step(). Shared mode leaves
            # the tracker to the framework. Device ops only, no host read.
            aux_loss.restore_tracker(self._kept)
        self._at_step_start = aux_loss.tracker_snapshot()

    def leave_step(self) -> None:
        self._kept = aux_loss.tracker_snapshot()

    def discard(self) -> None:
        self._kept = {}
        if self.own:  # shared: the tracker is the framework's; its own report decides
            aux_loss.clear_aux_loss_tracker()

    def restart(self) -> None:
        if self._at_step_start is not None:
            aux_loss.restore_tracker(self._at_step_start)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        pending = [
            aux_loss.enqueue_aux_loss_metrics(
                self.config,
                num_microbatches=num_microbatches,
                per_layer=self.cfg.moe_per_layer_logging,
                tracker=self.cfg.aux_loss_tracker,
            )
        ]
        if not self.own:
            pending.append(self._enqueue_uncleared_check())
        return pending

    def end_export(self) -> None:
        self._kept = {}
        self._at_step_start = None

    def _enqueue_uncleared_check(self) -> Pending[dict[str, Any]]:
        # Shared mode: the framework's report clears megatron's tracker after finish_step. If the
        # tracker held anything when this step began, nothing did, and values pile up over steps.
        start = self._at_step_start
        if self._warned_uncleared or not start:
            return done({})
        total = torch.stack([v.detach().float().abs().sum() for v in start.values()]).sum()

        def finish(host: list[Any]) -> dict[str, Any]:
            held = float(host[0].reshape(-1)[0])
            if held != 0.0 and not self._warned_uncleared:
                self._warned_uncleared = True
                warnings.warn(
                    f"aux_loss_tracker: shared, but megatron's aux-loss tracker still held values "
                    f"(sum {held:.4g}) when this step began: nothing cleared it after the previous "
                    "step, so megatron's and our moe/ aux losses add up over steps. Call "
                    "megatron's report after finish_step every step (track_moe_metrics on "
                    "megatron-core 0.16, get_moe_metrics_tracker().report on 0.19, as the "
                    "training_log of Megatron-Bridge and Megatron-LM does), or set "
                    "aux_loss_tracker: own to let nemo_moe_metrics clear it.",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return {}

        return Pending((total.reshape(1),), finish)


class ModelAuxLoss(MetricFamily):
    """A transformers model's own load-balancing loss per layer, from its router logits."""

    def __init__(self, accumulator: HFAuxLossAccumulator, cfg: MetricsConfig) -> None:
        """``accumulator`` is fed by router hooks that the collector gates."""
        self.accumulator = accumulator
        self.cfg = cfg

    def discard(self) -> None:
        self.accumulator.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [
            enqueue_hf_aux_loss_metrics(
                self.accumulator,
                self.accumulator.layers,
                num_microbatches=num_microbatches,
                per_layer=self.cfg.moe_per_layer_logging,
            )
        ]


def model_aux_loss(context: BuildContext) -> ModelAuxLoss | None:
    """The loss the model's own training computes (transformers' ``load_balancing_loss_func``),
    per layer, from the router logits the model records as ``router_logits``; None when the
    model family finds no such source."""
    find, collector = context.model_family.aux_loss_sources, context.collector
    if find is None or collector is None:
        return None
    kind, sources = find(context.chunks, collector.blocks)
    if not sources:
        return None
    layers = collector.layer_ids
    experts = dict(zip(layers, collector.num_experts, strict=True))
    topks = dict(zip(layers, collector.topks, strict=True))
    size = max(context.facts.num_layers, max(layers) + 1)
    accumulator = HFAuxLossAccumulator(
        size, [source[0] for source in sources], kind, staging=collector.staging
    )
    for layer, router, logits_at, ids_at in sources:
        observe = accumulator.observer(logits_at, experts[layer], topks[layer], ids_at)
        collector.observe_module(router, layer, observe)
    return ModelAuxLoss(accumulator, context.cfg)


def build(context: BuildContext) -> MetricFamily | None:
    """The model's own aux loss where it has one, else megatron's tracker where the config
    says megatron computes the losses; None for a model without aux losses."""
    if not context.moe:
        return None
    model_aux = model_aux_loss(context)
    if model_aux is not None:
        return model_aux
    if context.facts.aux_loss == "megatron":
        return MegatronAuxLoss(context.config, context.cfg)
    return None


__all__ = ["MegatronAuxLoss", "ModelAuxLoss", "build", "model_aux_loss"]
