"""What expert imbalance costs a step: ``train_perf/expert_imbalance_slowdown``.

Host arithmetic (``moe.imbalance_cost``) on two other families' results of the same export:
the routed experts' share of the estimated FLOPs (:attr:`Throughput.routed_flops_per_token`)
and the busiest EP rank's share of the routed work (:attr:`ExpertLoads.busiest_share`). No
collective and no device work of its own.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.families.expert_load import ExpertLoads
from nemo_moe_metrics.families.throughput import Throughput
from nemo_moe_metrics.moe.imbalance_cost import expert_imbalance_slowdown


class ImbalanceSlowdown(MetricFamily):
    """``train_perf/expert_imbalance_slowdown`` from the loads and the FLOP estimate."""

    def __init__(self, loads: ExpertLoads, routed_flops_per_token: float) -> None:
        """Built after ``loads`` and the throughput family, whose numbers it reads."""
        self.loads = loads
        self.routed_flops_per_token = routed_flops_per_token

    def complete(self, out: dict[str, Any]) -> None:
        flops, tokens = out.get(mn.ESTIMATED_FLOPS), out.get(mn.TOKENS)
        if not flops or not tokens:
            return
        share = self.loads.busiest_share
        if share is not None and out.get(mn.ROUTED_TOKENS):
            routed = min(1.0, self.routed_flops_per_token * tokens / flops)
            out[mn.EXPERT_IMBALANCE_SLOWDOWN] = expert_imbalance_slowdown(
                routed, share, self.loads.ep_size
            )


def build(context: BuildContext) -> ImbalanceSlowdown | None:
    """With expert loads and a FLOP estimate whose routed experts are known."""
    loads, throughput = context.family(ExpertLoads), context.family(Throughput)
    if loads is None or throughput is None or not throughput.routed_flops_per_token:
        return None
    return ImbalanceSlowdown(loads, throughput.routed_flops_per_token)


__all__ = ["ImbalanceSlowdown", "build"]
