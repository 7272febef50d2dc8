"""The metric families ``PolicyMetrics`` runs each step: one module each, one registration list.

``PolicyMetrics.attach`` calls every ``build`` of :data:`REGISTERED`, in order, with one
:class:`~nemo_moe_metrics.families.base.BuildContext`; each returns its family or None (the
flags or the model leave it out). The order is the export's: the aux losses, then the expert
loads (their first export agrees the layers), then the families that use the agreed layers or
the loads' results, then throughput and what follows from it. A new family is one module here
and one line below (docs/en/metric_families.md).
"""

from __future__ import annotations

from nemo_moe_metrics.families import (
    aux_loss,
    expert_bias,
    expert_load,
    imbalance,
    overload,
    rollout_load,
    router_health,
    routing_consistency,
    throughput,
)
from nemo_moe_metrics.families.base import Build, BuildContext, MetricFamily

#: Every family's build, in export order.
REGISTERED: tuple[Build, ...] = (
    aux_loss.build,
    expert_load.build,
    overload.build,
    rollout_load.build,
    expert_bias.build,
    router_health.build,
    routing_consistency.build,
    throughput.build,
    imbalance.build,
)

__all__ = ["REGISTERED", "Build", "BuildContext", "MetricFamily"]
