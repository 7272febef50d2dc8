"""Expert loads: per-layer counts reduced over ranks, balance statistics and the table.

``moe/max_over_ideal``, ``moe/expert_loads`` and the other balance keys (docs/en/expert_load.md),
from the collector's own counts. Its first export agrees the global MoE layers on every rank;
the families that report per layer after it (router health, expert bias) read that agreed
layout from :attr:`ExpertLoads.layer_ids` and :attr:`ExpertLoads.topks`.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.moe.balance import ExpertLoads as BalanceLoads
from nemo_moe_metrics.moe.balance import expert_load_metrics
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.imbalance_cost import busiest_rank_share
from nemo_moe_metrics.moe.reduction import ExpertLoadReducer


class ExpertLoads(MetricFamily):
    """Per-layer expert loads and balance (``moe/max_over_ideal``, the table, ...)."""

    def __init__(
        self,
        collector: ExpertLoadCollector | None,
        reducer: ExpertLoadReducer,
        cfg: MetricsConfig,
        ep_size: int,
    ) -> None:
        """``collector`` is None on a megatron pipeline stage without MoE layers."""
        self.collector = collector
        self.reducer = reducer
        self.cfg = cfg
        self.ep_size = ep_size
        self.busiest_share: float | None = None  # of the last export (None: no work)
        if collector is not None:
            collector.counting = False  # only inside step()

    @property
    def layer_ids(self) -> list[int]:
        """The global MoE layers every rank agreed at the first export (empty before it)."""
        return self.reducer.layer_ids

    @property
    def topks(self) -> list[int]:
        """Top-k of each agreed layer, in :attr:`layer_ids` order (empty before the export)."""
        return self.reducer.topks

    def enter_step(self) -> None:
        if self.collector is not None:
            self.collector.counting = True

    def leave_step(self) -> None:
        if self.collector is not None:
            self.collector.counting = False

    def discard(self) -> None:
        # Also resets every subscription of the collector (router health, routing, overload).
        if self.collector is not None:
            self.collector.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        loads = self.reducer.enqueue(self.collector)
        return [loads.then(self._metrics)]

    def _metrics(self, result: BalanceLoads) -> dict[str, Any]:
        widths = [result.experts_of(i) for i in range(len(result.layer_ids))]
        # The busiest EP rank's share of the step's work, for expert_imbalance_slowdown.
        self.busiest_share = (
            busiest_rank_share(result.executed_counts, self.ep_size, widths)
            if len(result.layer_ids)
            else None
        )
        return expert_load_metrics(
            result,
            per_layer=self.cfg.moe_per_layer_logging,
            table=self.cfg.log_expert_table,
            ep_size=self.ep_size,
        )

    def detach(self) -> None:
        if self.collector is not None:
            self.collector.detach()
            self.collector = None


def build(context: BuildContext) -> ExpertLoads | None:
    """Every MoE model, on every rank (a stage without MoE layers joins the reduce)."""
    if not context.moe:
        return None
    reducer = ExpertLoadReducer(None)
    return ExpertLoads(context.collector, reducer, context.cfg, context.facts.ep_size)


__all__ = ["ExpertLoads", "build"]
