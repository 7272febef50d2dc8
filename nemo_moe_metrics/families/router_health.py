"""Router decision health: how confident and how fragile the routers' decisions are.

``moe/router_*`` and ``moe/max_over_ideal_microbatch`` (docs/en/router_health.md). The arithmetic
is ``moe.router_health`` and its accumulators ``moe.health_tracker``; this module finds each
router's health reader (its spec's ``health``), subscribes to the collector to hand every counted
training forward's logits, bias and choice to the tracker (:class:`HealthObserver`), and reduces
over the layers the expert loads agreed.
"""

from __future__ import annotations

import warnings
from typing import Any

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.families.expert_load import ExpertLoads
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.health_tracker import RouterHealthTracker
from nemo_moe_metrics.moe.reduction import RouterHealthReducer, default_contribute
from nemo_moe_metrics.moe.router_spec import HealthSource, rows_of
from nemo_moe_metrics.moe.subscriptions import (
    TRAINING,
    CountedForwards,
    ForwardObserver,
    RouterForward,
)


class HealthObserver(ForwardObserver):
    """Reads each hooked router's decision in every forward (a captured logits tensor never
    outlives its forward) and hands the counted training ones to the tracker."""

    def __init__(self, collector: ExpertLoadCollector, near_tie_gap: float) -> None:
        """Finds each router's health reader; one warning names the routers without one.

        Routers whose class knows no health reader, or whose score function cannot be
        determined, get no router-health keys; every router still reports
        ``max_over_ideal_microbatch``.
        """
        scorings: dict[int, Any] = dict.fromkeys(collector.layer_ids)
        skipped: list[str] = []
        self._sources: dict[int, HealthSource] = {}  # id(matched module) -> its reader
        for router in collector.routers:
            spec = router.spec
            try:
                found = (
                    spec.health(router.module, router.parent)
                    if spec.health is not None
                    else "registered without a health reader"
                )
            except ValueError as err:  # a scoring the arithmetic cannot follow (RouterScoring)
                found = str(err)
            if isinstance(found, str):
                skipped.append(f"{router.name} ({found})")
                continue
            self._sources[id(router.module)] = found
            scorings[router.layer_id] = found.scoring
        if skipped:
            warnings.warn(
                "track_router_health: no moe/...router_* keys for the layers of "
                f"{len(skipped)} router(s): {'; '.join(skipped[:3])}"
                f"{' ...' if len(skipped) > 3 else ''}. Their max_over_ideal_microbatch is "
                "still logged.",
                RuntimeWarning,
                stacklevel=3,
            )
        self.tracker = RouterHealthTracker(
            scorings,
            near_tie_gap=near_tie_gap,
            device=collector.device,
            before_stats=collector.count_kept,
            staging=collector.staging,
        )

    def forward(self, fwd: RouterForward) -> None:
        source = self._sources.get(id(fwd.matched))
        decision = source.read(fwd.args, fwd.kwargs, fwd.output) if source is not None else None
        if fwd.kind != TRAINING:
            return
        logits, bias, valid = decision if decision is not None else (None, None, None)
        if valid is None and logits is not None and fwd.valid is not None:
            valid = rows_of(fwd.valid, logits.reshape(-1, logits.shape[-1]).shape[0])
        chosen = (  # zero-computation picks arrive remapped: not the choice
            source.chosen(fwd.args, fwd.kwargs, fwd.output)
            if source is not None and source.chosen is not None and not fwd.spec.zero_computation
            else None
        )
        self.tracker.observe(
            fwd.layer_id, fwd.counts, logits, bias=bias, valid=valid, chosen=chosen
        )

    def counted(self, forwards: CountedForwards) -> None:
        self.tracker.observe_forwards(forwards.layer_ids, forwards.routed)

    def reset(self) -> None:
        self.tracker.reset()

    def detach(self) -> None:
        for source in self._sources.values():
            if source.release is not None:
                source.release()
        self._sources.clear()


def enable_health(collector: ExpertLoadCollector, near_tie_gap: float) -> RouterHealthTracker:
    """Judge ``collector``'s routers' decisions from their own logits (``moe.router_health``):
    subscribes a :class:`HealthObserver` and returns its tracker."""
    observer = HealthObserver(collector, near_tie_gap)
    collector.subscribe(observer)
    return observer.tracker


class RouterHealth(MetricFamily):
    """How confident and fragile the routers' decisions are (``moe/router_*``)."""

    def __init__(
        self, loads: ExpertLoads, collector: ExpertLoadCollector | None, cfg: MetricsConfig
    ) -> None:
        """Enqueued after ``loads``: their first export agrees the layers. ``collector`` None:
        a pipeline stage without MoE layers (it joins the reduce with zeros)."""
        self.loads = loads
        self.collector = collector
        self.cfg = cfg
        #: the subscription that feeds the tracker (None without a collector)
        self.observer: HealthObserver | None = None
        self.tracker: RouterHealthTracker | None = None
        if collector is not None:
            self.observer = HealthObserver(collector, cfg.router_near_tie_gap)
            collector.subscribe(self.observer)
            self.tracker = self.observer.tracker
        self.reducer = RouterHealthReducer(None)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [
            self.reducer.enqueue(
                self.tracker,
                self.loads.layer_ids,
                self.loads.topks,
                per_layer=self.cfg.moe_per_layer_logging,
                contribute=default_contribute(self.collector),
            )
        ]


def build(context: BuildContext) -> RouterHealth | None:
    """With ``track_router_health``, on every rank of a MoE model."""
    loads = context.family(ExpertLoads)
    if not context.moe or loads is None or not context.cfg.track_router_health:
        return None
    return RouterHealth(loads, context.collector, context.cfg)


__all__ = ["HealthObserver", "RouterHealth", "build", "enable_health"]
