"""Routing consistency: the rollout engine's routes against the training routers'
(``moe/routing_*``).

The comparison is ``moe.routing``'s :class:`RoutingTracker` and its reduce ``moe.reduction``'s
``RoutingReducer`` (docs/en/routing_consistency.md); this module checks the routers can be
compared, subscribes to the collector to hand every counted training forward's own choice to the
tracker (:class:`RoutesObserver`), and passes ``microbatch(rollout_routes=...)`` on.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.reduction import RoutingReducer, default_contribute
from nemo_moe_metrics.moe.router_spec import mtp_index
from nemo_moe_metrics.moe.routing import RoutingTracker
from nemo_moe_metrics.moe.subscriptions import TRAINING, ForwardObserver, RouterForward


class RoutesObserver(ForwardObserver):
    """Hands each counted training forward's own choice (its spec's ``routes_fn``) of a
    compared layer to the tracker."""

    def __init__(
        self, collector: ExpertLoadCollector, moe_layers: list[int], rollout_experts: int = 0
    ) -> None:
        """``moe_layers``: every MoE layer of the model (global ids, model order), the layer
        axis of the rollout routes. Megatron routers with router replay configured also report
        their own top-k under replay (``megatron.compat.capture_router_choice``).
        ``rollout_experts`` > 0 also counts the rollout's own expert load (``RoutingTracker``).
        """
        routers = collector.routers
        unsupported = [r.name for r in routers if r.spec.routes_fn is None]
        if unsupported:
            raise ValueError(
                f"track_routing_consistency: routers {unsupported[:3]} were registered without a "
                "routes function; routing consistency supports megatron-core and Hugging Face "
                "routers"
            )
        # Rollout engines return routes for the decoder's MoE layers only: MTP layers (and any
        # other layer outside moe_layers) are counted but not compared.
        wanted = set(moe_layers)
        layers = collector.layer_ids
        compared = [i for i, layer in enumerate(layers) if layer in wanted]
        topks = {collector.topks[i] for i in compared}
        if len(topks) > 1:
            raise ValueError(
                f"track_routing_consistency: the MoE layers route to different numbers of "
                f"experts per token {sorted(topks)}; rollout routes need one top-k"
            )
        for router in routers:
            if router.spec.capture_choice is not None and mtp_index(router.name) is None:
                router.spec.capture_choice(router.module)
        self._compared = {layers[i] for i in compared}
        self.tracker = RoutingTracker(
            [layers[i] for i in compared],
            moe_layers,
            topks.pop(),
            [collector.num_experts[i] for i in compared],
            collector.device,
            sequence_major=any(r.spec.sequence_major for r in routers),
            rollout_experts=rollout_experts,
        )

    def forward(self, fwd: RouterForward) -> None:
        if fwd.kind == TRAINING and fwd.layer_id in self._compared:
            self.tracker.observe(fwd.layer_id, *fwd.apply(fwd.spec.routes_fn))

    def reset(self) -> None:
        self.tracker.reset()


def enable_routing(
    collector: ExpertLoadCollector, moe_layers: list[int], *, rollout_experts: int = 0
) -> RoutingTracker:
    """Compare rollout routes with ``collector``'s routers' choices: subscribes a
    :class:`RoutesObserver` and returns its tracker."""
    observer = RoutesObserver(collector, moe_layers, rollout_experts)
    collector.subscribe(observer)
    return observer.tracker


class RoutingConsistency(MetricFamily):
    """The rollout engine's routes against the training routers' (``moe/routing_*``)."""

    takes_rollout_routes = True

    def __init__(
        self,
        collector: ExpertLoadCollector | None,
        moe_layers: list[int],
        topk: int,
        rollout_experts: int,
        cfg: MetricsConfig,
    ) -> None:
        """``moe_layers``: the decoder's MoE layers, the layer axis of the rollout routes."""
        self.collector = collector
        self.cfg = cfg
        #: the subscription that feeds the tracker (None without a collector)
        self.observer: RoutesObserver | None = None
        self.tracker: RoutingTracker | None = None
        if collector is not None:
            self.observer = RoutesObserver(collector, moe_layers, rollout_experts)
            collector.subscribe(self.observer)
            self.tracker = self.observer.tracker
        self.reducer = RoutingReducer(moe_layers, topk, rollout_experts=rollout_experts)

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        if self.tracker is not None:
            self.tracker.set_routes(rollout_routes, num_sequences=num_sequences)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [
            self.reducer.enqueue(
                self.tracker,
                per_layer=self.cfg.moe_per_layer_logging,
                contribute=default_contribute(self.collector),
            )
        ]


def build(context: BuildContext) -> RoutingConsistency | None:
    """With ``track_routing_consistency``: the MoE layers from the config (megatron: every
    stage knows them) or from the hooked routers; None without either."""
    cfg, collector = context.cfg, context.collector
    if not context.moe or not cfg.track_routing_consistency:
        return None
    if context.model_family.moe_layers is not None:  # the config says them (megatron)
        moe_layers, topk = context.model_family.moe_layers(context.config)
    elif collector is None:
        return None
    else:
        moe_layers, topk = collector.layer_ids, collector.topk
    # With router health, the rollout engine's own load too (moe/rollout_max_over_ideal).
    rollout_experts = context.facts.num_experts if cfg.track_router_health else 0
    return RoutingConsistency(collector, moe_layers, topk, rollout_experts, cfg)


__all__ = ["RoutesObserver", "RoutingConsistency", "build", "enable_routing"]
