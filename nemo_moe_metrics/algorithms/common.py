"""What the three loops share: the log callback type, merging, the per-rank batch and a
data-parallel mean."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_metrics.worker.results import merge_step_metrics

LogFn = Callable[[dict[str, Any], int], None]

__all__ = [
    "LogFn",
    "dp_mean",
    "masked_sequence_mean",
    "merge_step_metrics",
    "rank_batch_size",
]


def rank_batch_size(recipe: Any, dp_size: int, *, whole: int = 1) -> int:
    """Sequences one data-parallel rank trains per step: ``policy.train_global_batch_size``
    counts all data-parallel ranks together (as in NeMo RL and Megatron). ``whole``: a group
    size each rank's share must hold whole (GRPO's generations, DPO's pairs)."""
    gbs, mbs = recipe.policy.train_global_batch_size, recipe.policy.train_micro_batch_size
    unit = dp_size * math.lcm(mbs, whole)
    if gbs % unit:
        raise ValueError(
            f"policy.train_global_batch_size={gbs} counts the sequences of all {dp_size} "
            f"data-parallel rank(s) together, so it must be a multiple of {unit} (data-parallel "
            f"size {dp_size} x train_micro_batch_size={mbs}"
            + (f", in whole groups of {whole}" if whole > 1 else "")
            + ")"
        )
    return gbs // dp_size


def dp_mean(values: dict[str, float], group: Any, size: int) -> dict[str, float]:
    """Mean of scalar values over the data-parallel ranks (one all-reduce; identity at size 1)."""
    if size == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, (t / size).tolist(), strict=True))


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of ``values`` over ``mask`` (``[b, t]`` -> ``[b]``), 0 where empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
