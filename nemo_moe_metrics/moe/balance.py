"""Expert-load balance statistics: pure numpy functions, no torch.distributed.

Input is an :class:`ExpertLoads` (already reduced over ranks); output is a flat metric dict with
keys from :mod:`nemo_moe_metrics.export.metric_names`. A layer that routed no tokens reports 0 for
every statistic (there is nothing to judge), never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.expert_table import ExpertTable


@dataclass(frozen=True)
class ExpertLoads:
    """Reduced expert assignment counts of one training step (identical on every rank).

    ``counts[i, e]``: routed assignments of global layer ``layer_ids[i]`` to expert ``e``:
    non-padding tokens, after capacity dropping (a token routed to k experts counts k times).
    ``routed_tokens[i]``: non-padding tokens the router of that layer saw.
    ``topk``: experts per token, one number for the model or one per layer. Layers with fewer
    experts than ``counts.shape[1]`` are padded with zeros on the right; ``num_experts[i]`` says
    how many columns are real.
    ``executed[i, e]``: assignments the dispatcher handed to expert ``e``, padding tokens
    included (megatron-core routes padding too); None means equal to ``counts`` (routers that
    cannot see padding, such as Hugging Face's).
    ``zero_picks[i]``: top-k picks of zero-computation experts (longcat_flash, zaya), which are
    not in ``counts``; None for a model without such experts.
    """

    layer_ids: list[int]
    counts: np.ndarray
    routed_tokens: np.ndarray
    topk: int | list[int]
    num_experts: list[int] | None = None
    executed: np.ndarray | None = None
    zero_picks: np.ndarray | None = None

    def experts_of(self, i: int) -> int:
        """Number of real experts of row ``i``."""
        return self.num_experts[i] if self.num_experts is not None else int(self.counts.shape[1])

    def topk_of(self, i: int) -> int:
        """Experts per token of row ``i``."""
        return self.topk if isinstance(self.topk, int) else int(self.topk[i])

    def zero_picks_of(self, i: int) -> int:
        """Picks of zero-computation experts of row ``i`` (0 without such experts)."""
        return 0 if self.zero_picks is None else int(self.zero_picks[i])

    @property
    def executed_counts(self) -> np.ndarray:
        """``executed`` where known, else ``counts`` (executed equals routed there)."""
        return self.counts if self.executed is None else np.asarray(self.executed)


def _check_counts(counts: np.ndarray) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 1:
        raise ValueError(f"expected a 1-D per-expert count vector, got shape {c.shape}")
    if c.size == 0:
        raise ValueError("a layer needs at least one expert; got an empty count vector")
    if np.any(c < 0):
        raise ValueError(f"expert counts must be >= 0, got {c.tolist()}")
    return c.astype(np.float64)


def max_over_ideal(counts: np.ndarray) -> float:
    """Busiest expert over the ideal (uniform) load: ``max(c) / mean(c)``; 1 is perfect, 0 if
    empty."""
    c = _check_counts(counts)
    total = c.sum()
    return float(c.max() * c.size / total) if total > 0 else 0.0


def min_over_ideal(counts: np.ndarray) -> float:
    """Least-loaded expert over the ideal load: ``min(c) / mean(c)``; 1 is perfect, 0 if empty."""
    c = _check_counts(counts)
    total = c.sum()
    return float(c.min() * c.size / total) if total > 0 else 0.0


def coefficient_of_variation(counts: np.ndarray) -> float:
    """Population standard deviation over mean of the per-expert counts; 0 is perfect."""
    c = _check_counts(counts)
    mean = c.mean()
    return float(c.std() / mean) if mean > 0 else 0.0


def normalized_entropy(counts: np.ndarray) -> float:
    """Entropy of the load distribution over ``log(E)``: 1 is uniform, 0 is one expert (or
    empty)."""
    c = _check_counts(counts)
    total = c.sum()
    if total <= 0:
        return 0.0
    if c.size == 1:
        return 1.0
    p = c[c > 0] / total
    return float(-(p * np.log(p)).sum() / math.log(c.size))


def zero_token_experts(counts: np.ndarray) -> int:
    """Experts that received no token; 0 for a layer that routed no tokens at all."""
    c = _check_counts(counts)
    return int((c == 0).sum()) if c.sum() > 0 else 0


def ep_rank_loads(counts: np.ndarray, ep_size: int) -> np.ndarray:
    """Tokens per expert-parallel rank, experts placed as megatron-core does: contiguous blocks.

    EP rank ``r`` holds experts ``[r * E/ep, (r+1) * E/ep)``.
    """
    c = _check_counts(counts)
    if ep_size < 1 or c.size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must be >= 1 and divide the number of experts ({c.size}); "
            "pass the expert_model_parallel_size the model was built with"
        )
    return c.reshape(ep_size, -1).sum(axis=1)


def ep_imbalance(counts: np.ndarray, ep_size: int) -> float:
    """Busiest EP rank's tokens over the mean EP rank (the all-to-all straggler); 0 if empty.

    Pass executed counts (padding included): the experts' real work.
    """
    return max_over_ideal(ep_rank_loads(counts, ep_size))


def padding_fraction(counts: np.ndarray, executed: np.ndarray) -> float:
    """Share of the experts' executed assignments that were padding: ``1 - routed / executed``.

    0 when nothing was executed, and for routers that cannot see padding (executed == routed).
    """
    c, x = _check_counts(counts), _check_counts(executed)
    routed, total = c.sum(), x.sum()
    if c.size != x.size or routed > total:
        raise ValueError(
            f"routed counts (sum {routed:.0f}, {c.size} experts) exceed executed counts (sum "
            f"{total:.0f}, {x.size} experts); executed = routed + padding assignments, per layer"
        )
    return float(1.0 - routed / total) if total > 0 else 0.0


def dropped_fraction(
    counts: np.ndarray, routed_tokens: int, topk: int, zero_picks: int = 0
) -> float:
    """``1 - assignments / (tokens * topk - zero_picks)``: share of top-k choices dropped by
    expert capacity (picks of zero-computation experts are not dropped: they need no expert).

    Exactly 0 without a capacity factor (nothing is dropped); 0 for a layer that saw no tokens.
    """
    c = _check_counts(counts)
    if routed_tokens < 0 or topk < 1 or zero_picks < 0:
        raise ValueError(
            f"routed_tokens and zero_picks must be >= 0 and topk >= 1, got {routed_tokens}, "
            f"{zero_picks}, {topk}"
        )
    wanted = float(routed_tokens) * topk - zero_picks
    return float(1.0 - c.sum() / wanted) if wanted > 0 else 0.0


def zero_expert_fraction(routed_tokens: int, topk: int, zero_picks: int) -> float:
    """Share of the top-k picks that went to zero-computation experts; 0 if no token."""
    wanted = float(routed_tokens) * topk
    return float(zero_picks / wanted) if wanted > 0 else 0.0


def load_percent(counts: np.ndarray) -> np.ndarray:
    """Each expert's share of the layer's assignments in percent (sums to 100; zeros if empty)."""
    c = _check_counts(counts)
    total = c.sum()
    return c * (100.0 / total) if total > 0 else np.zeros_like(c)


def layer_statistics(
    counts: np.ndarray,
    routed_tokens: int,
    topk: int,
    ep_size: int = 1,
    executed: np.ndarray | None = None,
    zero_picks: int | None = None,
) -> dict[str, float]:
    """Every per-layer statistic of ``metric_names.LAYER_STATS`` for one layer, plus
    ``zero_expert_fraction`` when ``zero_picks`` is given (a router with zero-computation experts).

    Routing statistics use the routed ``counts``; ``ep_imbalance`` and ``padding_fraction``
    describe the experts' work and use ``executed`` (default: equal to ``counts``).
    """
    work = counts if executed is None else executed
    stats = {
        "max_over_ideal": max_over_ideal(counts),
        "min_over_ideal": min_over_ideal(counts),
        "coefficient_of_variation": coefficient_of_variation(counts),
        "normalized_entropy": normalized_entropy(counts),
        "zero_token_experts": float(zero_token_experts(counts)),
        "ep_imbalance": ep_imbalance(work, ep_size),
        "dropped_fraction": dropped_fraction(counts, routed_tokens, topk, zero_picks or 0),
        "padding_fraction": padding_fraction(counts, work),
    }
    if zero_picks is not None:
        stats[mn.ZERO_EXPERT_STAT] = zero_expert_fraction(routed_tokens, topk, zero_picks)
    return stats


def linear_percentile(ordered: Sequence[float], percent: float) -> float:
    """``np.percentile(ordered, percent)`` (numpy's default, linear) of finite values sorted
    ascending: numpy's own index arithmetic and interpolation, so the same float, without its
    ~0.1 ms of set-up a call."""
    n = len(ordered)
    q = percent / 100
    virtual = (n - 1) * q  # numpy's virtual index for its linear method
    if virtual >= n - 1:
        return float(ordered[-1])
    below = math.floor(virtual)
    a, b, t = float(ordered[below]), float(ordered[below + 1]), virtual - below
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def max_over_ideal_spread(
    layer_ids: list[int], stats: list[tuple[bool, dict[str, float]]]
) -> dict[str, float]:
    """``moe/max_over_ideal_p50`` and ``_p90`` (numpy's default, linear, percentile over the MoE
    layers that routed tokens) and ``moe/worst_layer`` (global id of the highest; the lowest
    id on a tie). Empty when no layer routed a token."""
    ratios = [
        (s["max_over_ideal"], layer) for layer, (ok, s) in zip(layer_ids, stats, strict=True) if ok
    ]
    if not ratios:
        return {}
    ordered = sorted(float(r) for r, _ in ratios)
    worst = max(ratios, key=lambda pair: (pair[0], -pair[1]))[1]
    p50, p90 = linear_percentile(ordered, 50), linear_percentile(ordered, 90)
    return {
        mn.MAX_OVER_IDEAL_P50: p50,
        mn.MAX_OVER_IDEAL_P90: p90,
        mn.WORST_LAYER: float(worst),
    }


def expert_load_metrics(
    loads: ExpertLoads, *, per_layer: bool, table: bool, ep_size: int = 1
) -> dict[str, float | ExpertTable]:
    """Balance summaries (and optionally per-layer values and the expert table, an
    :class:`~nemo_moe_metrics.export.expert_table.ExpertTable`) of one step.

    Summaries: ``moe/max_over_ideal`` and ``moe/ep_imbalance`` are means over MoE layers that
    routed tokens this step, ``..._max`` the worst layer, ``moe/max_over_ideal_p50`` / ``_p90``
    and ``moe/worst_layer`` their spread (:func:`max_over_ideal_spread`); ``moe/dead_experts``
    counts (layer, expert) pairs with no token; ``moe/dropped_fraction`` and
    ``moe/padding_fraction`` are over all layers together, as is ``moe/zero_expert_fraction`` (only
    for a model with zero-computation experts). ``ep_imbalance`` and ``padding_fraction`` use the
    executed counts (padding included), everything else and the table the routed ones.
    ``moe/routed_tokens`` is the busiest layer's routed tokens; a step in which no expert
    received a training token returns that key alone (0), no statistic of nothing.
    Returns ``{}`` when there is no MoE layer.
    """
    counts = np.asarray(loads.counts)
    executed = loads.executed_counts
    n = len(loads.layer_ids)
    if (
        counts.ndim != 2
        or counts.shape[0] != n
        or len(loads.routed_tokens) != n
        or executed.shape != counts.shape
    ):
        raise ValueError(
            f"ExpertLoads is inconsistent: {n} layer ids, counts shape {counts.shape}, "
            f"executed shape {executed.shape}, {len(loads.routed_tokens)} routed-token entries; "
            "build it with export_expert_loads"
        )
    if n == 0:
        return {}
    routed = float(np.asarray(loads.routed_tokens, dtype=np.float64).max())
    picks = sum(float(loads.routed_tokens[i]) * loads.topk_of(i) for i in range(n))
    zero = float(np.sum(loads.zero_picks)) if loads.zero_picks is not None else 0.0
    if counts.sum() == 0:
        if zero:  # every pick went to a zero-computation expert: that much is true
            return {mn.ROUTED_TOKENS: routed, mn.ZERO_EXPERT_FRACTION: zero / picks}
        return {mn.ROUTED_TOKENS: routed}
    out: dict[str, float | ExpertTable] = {mn.ROUTED_TOKENS: routed}
    stats = _every_layer_statistics(loads, counts, executed, ep_size)
    if per_layer:
        for layer, (_, s) in zip(loads.layer_ids, stats, strict=True):
            for name, value in s.items():
                out[mn.layer_stat_key(layer, name)] = value
    active = [s for ok, s in stats if ok]
    out[mn.MAX_OVER_IDEAL] = (
        float(np.mean([s["max_over_ideal"] for s in active])) if active else 0.0
    )
    out[mn.MAX_OVER_IDEAL_MAX] = max((s["max_over_ideal"] for s in active), default=0.0)
    out.update(max_over_ideal_spread(loads.layer_ids, stats))
    out[mn.EP_IMBALANCE] = float(np.mean([s["ep_imbalance"] for s in active])) if active else 0.0
    out[mn.EP_IMBALANCE_MAX] = max((s["ep_imbalance"] for s in active), default=0.0)
    out[mn.DEAD_EXPERTS] = float(sum(s["zero_token_experts"] for _, s in stats))
    wanted = picks - zero
    out[mn.DROPPED_FRACTION] = float(1.0 - counts.sum() / wanted) if wanted > 0 else 0.0
    if loads.zero_picks is not None:
        out[mn.ZERO_EXPERT_FRACTION] = zero / picks if picks > 0 else 0.0
    work = float(executed.sum())
    out[mn.PADDING_FRACTION] = float(1.0 - counts.sum() / work) if work > 0 else 0.0
    if table:  # one array value; the rows only where a sink asks for them
        widths = [loads.experts_of(i) for i in range(n)]
        out[mn.EXPERT_LOADS] = ExpertTable(loads.layer_ids, counts, widths)
    return out


def _every_layer_statistics(
    loads: ExpertLoads, counts: np.ndarray, executed: np.ndarray, ep_size: int
) -> list[tuple[bool, dict[str, float]]]:
    """Per layer: ``(routed any token, layer_statistics(...))``; when every layer has the same
    experts, the same statistics computed for all layers at once (a numpy pass per statistic,
    not one per layer and statistic)."""
    n = len(loads.layer_ids)
    widths = {loads.experts_of(i) for i in range(n)}
    if len(widths) != 1 or widths.pop() != counts.shape[1] or np.any(counts < 0):
        return [_one_layer_statistics(loads, counts, executed, ep_size, i) for i in range(n)]
    c, x = counts.astype(np.float64), np.asarray(executed, dtype=np.float64)
    experts = c.shape[1]
    tokens = np.array([int(t) for t in loads.routed_tokens], dtype=np.float64)
    topks = np.array([loads.topk_of(i) for i in range(n)], dtype=np.float64)
    zero = np.array([loads.zero_picks_of(i) for i in range(n)], dtype=np.float64)
    total, work = c.sum(axis=1), x.sum(axis=1)
    invalid = ep_size < 1 or experts % ep_size or np.any(tokens < 0) or np.any(topks < 1)
    if invalid or np.any(x < 0) or np.any(total > work) or np.any(zero < 0):
        # layer_statistics raises, naming the layer's problem and its fix
        return [_one_layer_statistics(loads, counts, executed, ep_size, i) for i in range(n)]
    routed = total > 0
    per_total = np.divide(experts, total, out=np.zeros(n), where=routed)
    mean = total / experts
    share = np.divide(c, total[:, None], out=np.zeros_like(c), where=routed[:, None])
    plogp = np.multiply(
        share, np.log(share, out=np.zeros_like(c), where=c > 0), out=np.zeros_like(c), where=c > 0
    )
    entropy = (
        np.where(routed, -np.sum(plogp, axis=1, where=c > 0) / math.log(experts), 0.0)
        if experts > 1
        else routed.astype(np.float64)
    )
    rank_loads = x.reshape(n, ep_size, -1).sum(axis=2)
    rank_total = rank_loads.sum(axis=1)
    wanted = tokens * topks - zero
    picks = tokens * topks
    columns = {
        "max_over_ideal": c.max(axis=1) * per_total,
        "min_over_ideal": c.min(axis=1) * per_total,
        "coefficient_of_variation": np.divide(c.std(axis=1), mean, out=np.zeros(n), where=mean > 0),
        "normalized_entropy": entropy,
        "zero_token_experts": np.where(routed, (c == 0).sum(axis=1), 0).astype(np.float64),
        "ep_imbalance": np.divide(
            rank_loads.max(axis=1) * ep_size, rank_total, out=np.zeros(n), where=rank_total > 0
        ),
        "dropped_fraction": np.where(
            wanted > 0, 1.0 - np.divide(total, wanted, where=wanted > 0, out=np.zeros(n)), 0.0
        ),
        "padding_fraction": np.where(
            work > 0, 1.0 - np.divide(total, work, where=work > 0, out=np.zeros(n)), 0.0
        ),
    }
    if loads.zero_picks is not None:
        columns[mn.ZERO_EXPERT_STAT] = np.divide(zero, picks, out=np.zeros(n), where=picks > 0)
    return [
        (bool(routed[i]), {name: float(values[i]) for name, values in columns.items()})
        for i in range(n)
    ]


def _one_layer_statistics(
    loads: ExpertLoads, counts: np.ndarray, executed: np.ndarray, ep_size: int, i: int
) -> tuple[bool, dict[str, float]]:
    c = counts[i, : loads.experts_of(i)]
    stats = layer_statistics(
        c,
        int(loads.routed_tokens[i]),
        loads.topk_of(i),
        ep_size,
        executed=executed[i, : loads.experts_of(i)],
        zero_picks=None if loads.zero_picks is None else loads.zero_picks_of(i),
    )
    return c.sum() > 0, stats
