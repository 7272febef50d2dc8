"""megatron-core's overload factor with expert parallelism:
``moe/{avg,max,max_cum}_overload_factor``.

The arithmetic and the reduction are ``moe.overload``'s :class:`OverloadTracker`; this module
feeds it from the collector: each counted training forward's executed tokens per EP rank (a
subscription, :class:`OverloadObserver`), and reports it when tokens cross expert-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from nemo_moe_metrics.export.host_read import Pending, collective_device
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.overload import OverloadTracker
from nemo_moe_metrics.moe.router_spec import per_expert
from nemo_moe_metrics.moe.subscriptions import (
    TRAINING,
    CountedForwards,
    ForwardObserver,
    RouterForward,
)


class OverloadObserver(ForwardObserver):
    """Hands each counted training forward to the tracker: its order (forward, then backward)
    at once, its executed counts at once or, for kept picks, when the collector counts them."""

    def __init__(self, tracker: OverloadTracker) -> None:
        """``tracker``: the family's tracker, reset with the collector."""
        self.tracker = tracker
        self._index: dict[int, int] = {}  # a kept forward's serial -> its tracker index

    def forward(self, fwd: RouterForward) -> None:
        if fwd.kind != TRAINING:
            return
        index = self.tracker.forward(fwd.layer_id, fwd.output)
        if fwd.counts is None:  # picks kept: counted with the step's others (counted)
            self._index[fwd.serial] = index
            return
        # Dropless: the executed picks are rows x top-k.
        ran = fwd.counts if fwd.executed is None else per_expert(fwd.executed)
        self.tracker.add([index], ran.unsqueeze(0), [ran.sum()])

    def counted(self, forwards: CountedForwards) -> None:
        balanced = [
            rows * acc.topk for rows, acc in zip(forwards.rows, forwards.owners, strict=True)
        ]
        ran = forwards.executed if forwards.executed is not None else forwards.routed
        indices = [self._index.pop(serial) for serial in forwards.serials]
        self.tracker.add(indices, ran, balanced)

    def reset(self) -> None:
        self.tracker.reset()
        self._index.clear()


class OverloadFactor(MetricFamily):
    """megatron-core's overload factor (``moe/{avg,max,max_cum}_overload_factor``) with expert
    parallelism, from each counted forward's executed tokens per EP rank (``moe.overload``)."""

    def __init__(
        self,
        tracker: OverloadTracker,
        collector: ExpertLoadCollector | None,
        num_layers: int,
        ep_group: Any,
        ep_rank: int,
        per_layer: bool,
    ) -> None:
        """``collector`` None: a pipeline stage without MoE layers (it joins the reduce)."""
        self.tracker = tracker
        self.collector = collector
        self.num_layers = num_layers
        self.ep_group = ep_group
        self.ep_rank = ep_rank
        self.per_layer = per_layer
        self.observer: OverloadObserver | None = None
        if collector is not None:
            self.observer = OverloadObserver(tracker)
            collector.subscribe(self.observer)

    def discard(self) -> None:
        if self.observer is not None:
            self.observer.reset()
        else:
            self.tracker.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        if self.collector is not None:
            self.collector.count_kept()  # the kept forwards' counts reach the tracker
        device = collective_device(self.ep_group)
        pending = self.tracker.enqueue(self.num_layers, self.ep_group, self.ep_rank, device)
        if self.per_layer:
            return [pending]
        return [pending.then(lambda out: {k: v for k, v in out.items() if "_layer_" not in k})]


def build(context: BuildContext) -> OverloadFactor | None:
    """When tokens cross expert-parallel ranks (megatron, ``ep_size > 1``); every rank joins."""
    facts = context.facts
    if not context.moe or facts.ep_size <= 1:
        return None
    # megatron's overload factor needs each forward's tokens per EP rank and the EP group.
    group, rank = compat.expert_parallel_group() if dist.is_initialized() else (None, 0)
    mtp = int(getattr(context.config, "mtp_num_layers", 0) or 0)
    return OverloadFactor(
        OverloadTracker(facts.ep_size),
        context.collector,
        facts.num_layers + mtp,
        group,
        rank,
        context.cfg.moe_per_layer_logging,
    )


__all__ = ["OverloadFactor", "OverloadObserver", "build"]
