"""The expert load of the policy's own generation (``PolicyMetrics.generation()``).

``moe/rollout_max_over_ideal`` and per layer ``moe/layer_{i}/rollout_max_over_ideal``, from the
collector's rollout accumulators (its generation forwards, real tokens only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending
from nemo_moe_metrics.families.base import BuildContext, MetricFamily
from nemo_moe_metrics.moe.collector import ExpertLoadCollector


class RolloutLoad(MetricFamily):
    """The expert load of the policy's own generation (``PolicyMetrics.generation()``):
    ``moe/rollout_max_over_ideal`` and per layer ``moe/layer_{i}/rollout_max_over_ideal``.

    Exported only when a generation forward was counted since the last export; every rank
    generates at the same steps (TRL's GRPO does), so the sum over ranks lines up.
    """

    def __init__(self, collector: ExpertLoadCollector, per_layer: bool) -> None:
        """``collector``: whose rollout accumulators the generation forwards fill."""
        self.collector = collector
        self.per_layer = per_layer

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        collector = self.collector
        if not collector.rollout_seen:
            return []
        flat = torch.cat(collector.local_rollout())  # a copy: the accumulators restart at 0
        collector.reset_rollout()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        layers, sizes = collector.layer_ids, collector.num_experts
        per_layer = self.per_layer

        def finish(host: list[Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            ratios = []
            start = 0
            for layer, size in zip(layers, sizes, strict=True):
                counts = host[0][start : start + size]
                start += size
                total = int(counts.sum())
                if total == 0:
                    continue  # no generated token reached this layer: no ratio of nothing
                ratio = float(counts.max()) * size / total
                ratios.append(ratio)
                if per_layer:
                    out[mn.router_health_layer_key(layer, "rollout_max_over_ideal")] = ratio
            if ratios:
                out[mn.ROLLOUT_MAX_OVER_IDEAL] = sum(ratios) / len(ratios)
            return out

        return [Pending((flat,), finish)]


def build(context: BuildContext) -> RolloutLoad | None:
    """Models whole on every rank (Hugging Face, torchtitan): each rank generates, each joins
    (see ``PolicyMetrics.generation()``)."""
    collector = context.collector
    if not context.moe or collector is None or not context.model_family.whole_on_every_rank:
        return None
    return RolloutLoad(collector, context.cfg.moe_per_layer_logging)


__all__ = ["RolloutLoad", "build"]
