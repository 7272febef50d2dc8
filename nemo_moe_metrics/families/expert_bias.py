"""The aux-loss-free expert bias (``moe/expert_bias_*``): its range and its last update.

The device arithmetic and the reduce are ``moe.expert_bias``'s :class:`ExpertBiasTracker`; the
bias buffers come from the router specs (``collector.expert_bias_sources()``) and the layers
from the expert loads' agreed layout (``ExpertLoads.layer_ids``).
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.families.expert_load import ExpertLoads
from nemo_moe_metrics.moe.expert_bias import ExpertBiasTracker, split_layer_keys


class ExpertBias(MetricFamily):
    """The aux-loss-free expert bias (``moe/expert_bias_*``); every rank joins its reduce."""

    def __init__(self, tracker: ExpertBiasTracker, loads: ExpertLoads, per_layer: bool) -> None:
        """Enqueued after ``loads``: their first export agrees the layers."""
        self.tracker = tracker
        self.loads = loads
        self.per_layer = per_layer

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        per_layer = self.per_layer
        return [
            self.tracker.enqueue(self.loads.layer_ids).then(
                lambda bias: split_layer_keys(bias, per_layer)
            )
        ]


def build(context: BuildContext) -> ExpertBias | None:
    """When the config says the routers keep a bias, or (families without such a flag) some
    hooked layer holds one; every rank joins the reduce, a stage without MoE layers too."""
    loads = context.family(ExpertLoads)
    if not context.moe or loads is None:
        return None
    collector, model_family = context.collector, context.model_family
    sources = collector.expert_bias_sources() if collector else []
    if model_family.bias_from_modules:  # no config flag says it: the layers that hold a bias do
        sources = [(layer, get) for layer, get in sources if get() is not None]
    if not (context.facts.expert_bias or (model_family.bias_from_modules and sources)):
        return None
    return ExpertBias(ExpertBiasTracker(sources), loads, context.cfg.moe_per_layer_logging)


__all__ = ["ExpertBias", "build"]
