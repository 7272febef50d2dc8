"""What expert imbalance costs a training step: ``train_perf/expert_imbalance_slowdown``.

Pure arithmetic on host numbers (no torch.distributed):

- ``f``: the routed experts' share of the step's estimated FLOPs (the FLOP estimator's
  ``routed_experts`` component over its total);
- ``s``: the busiest expert-parallel rank's share of the routed work, with experts placed as
  megatron-core places them (EP rank ``r`` holds experts ``[r*E/G, (r+1)*E/G)``) and each
  layer waiting for its busiest rank: ``s = sum_l max_r load(l, r) / sum_l sum_r load(l, r)``
  (executed token counts, the experts' real work);
- slowdown ``= (1 - f) + f * G * s``: the step's estimated time with this step's loads over its
  time with perfectly balanced loads (``s = 1/G``).

Assumptions: the expert compute of a layer lasts as long as its busiest rank's; every other
part of the step (attention, dense layers, the routed part's balanced share) is unchanged;
communication (all-to-all volume and its own imbalance) is not modelled. 1.0 without expert
parallelism (``G = 1``) or with balance; MFU with balanced experts would be ``MFU * slowdown``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["busiest_rank_share", "expert_imbalance_slowdown", "routed_flops_per_token"]

#: The FLOP estimator's component of the routed experts (flops.core.ROUTED_EXPERTS).
ROUTED_COMPONENT = "routed_experts"


def busiest_rank_share(counts: np.ndarray, ep_size: int, widths: Any = None) -> float | None:
    """``sum_l max_r load(l, r) / sum_l load(l)`` over the layers of ``counts [L, E]`` (each
    layer's first ``widths[l]`` columns are its experts); None when no layer has work or a
    layer's experts do not split over ``ep_size`` ranks."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2 or ep_size < 1:
        raise ValueError(f"counts must be [layers, experts] and ep_size >= 1, got {c.shape}")
    width = np.full(c.shape[0], c.shape[1]) if widths is None else np.asarray(widths)
    busiest = total = 0.0
    for row, w in zip(c, width.tolist(), strict=True):
        if w % ep_size:
            return None
        ranks = row[:w].reshape(ep_size, -1).sum(axis=1)
        busiest += float(ranks.max())
        total += float(ranks.sum())
    return busiest / total if total > 0 else None


def expert_imbalance_slowdown(routed_share: float, busiest_share: float, ep_size: int) -> float:
    """``(1 - f) + f * G * s``: estimated step time with these loads over balanced loads."""
    if not 0.0 <= routed_share <= 1.0:
        raise ValueError(f"routed_share must be in [0, 1], got {routed_share}")
    if ep_size == 1:
        return 1.0
    if not 1.0 / ep_size - 1e-12 <= busiest_share <= 1.0 + 1e-12:
        raise ValueError(f"busiest_share must be in [1/{ep_size}, 1], got {busiest_share}")
    return (1.0 - routed_share) + routed_share * ep_size * busiest_share


def routed_flops_per_token(estimator: Any) -> float | None:
    """The routed experts' training FLOPs per token (they are linear in tokens: attention is
    not), read from the estimator's breakdown of one 1-token sequence; None when the estimator
    gives no ``routed_experts`` component."""
    try:
        estimate = estimator([1])
    except Exception:  # noqa: BLE001 - a custom estimator that cannot: no such metric
        return None
    parts = getattr(estimate, "by_component", None) or {}
    value = parts.get(ROUTED_COMPONENT)
    return float(value) if value else None
