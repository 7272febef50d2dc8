"""Placement plans from expert loads: GPU loads and balancedness of a placement, the
contiguous placement a run uses today, an EPLB plan with its before/after, a sweep over the
number of redundant experts, and the plan as JSON.

Definitions (the ones vLLM and SGLang log):

- a placement puts ``P = E + R`` physical experts on ``G`` GPUs, GPU ``g`` holding physical
  slots ``g*P/G ... (g+1)*P/G - 1``; a logical expert with ``c`` replicas sends each of them
  ``1/c`` of its tokens;
- a GPU's load is the sum of its physical experts' loads; a layer's **balancedness** is
  mean GPU load / max GPU load (1.0: perfectly even; a layer with no tokens counts as 1.0);
- the **contiguous placement** (no redundant experts) puts expert ``e`` on GPU ``e // (E/G)``;
- the expert part of a step waits, layer after layer, for the busiest GPU, so its time is
  proportional to the sum over layers of the max GPU load: a plan's expected expert-time
  ratio is ``sum_l max_after(l) / sum_l max_before(l)`` (communication not modelled).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import PER_GPU, REDUNDANCY, LimitError
from nemo_moe_metrics.placement.eplb import (
    check_layout,
    rebalance_experts,
    uses_hierarchical_policy,
)

__all__ = [
    "PlacementPlan",
    "SweepRow",
    "balancedness",
    "build_plan",
    "check_ep_size",
    "check_redundancy",
    "contiguous_placement",
    "extend_placement",
    "monotone_placements",
    "gpu_loads",
    "sweep",
    "sweep_redundancies",
]


def gpu_loads(weight: np.ndarray, physical_to_logical: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L, G]`` tokens each GPU computes: ``weight [L, E]`` split evenly over each expert's
    replicas in ``physical_to_logical [L, P]``, summed over each GPU's ``P/G`` slots.

    Summed over experts in expert order from (replicas on the GPU) / (replicas), so two
    placements that give a GPU the same share of every expert give it bit-identical loads.
    """
    weight = np.asarray(weight, dtype=np.float64)
    p2l = np.asarray(physical_to_logical)
    layers, num_logical = weight.shape
    on_gpu = _replicas_on_gpus(p2l, num_logical, num_gpus)
    share = on_gpu / np.maximum(on_gpu.sum(axis=1), 1)[:, None, :]
    return np.einsum("lge,le->lg", share, weight)


def _replicas_on_gpus(p2l: np.ndarray, num_logical: int, num_gpus: int) -> np.ndarray:
    """``[L, G, E]``: how many replicas of each expert each GPU holds."""
    layers, physical = p2l.shape
    slots = p2l.reshape(layers, num_gpus, physical // num_gpus)
    on_gpu = np.zeros((layers, num_gpus, num_logical), np.int64)
    np.add.at(
        on_gpu,
        (np.arange(layers)[:, None, None], np.arange(num_gpus)[None, :, None], slots),
        1,
    )
    return on_gpu


def balancedness(loads: np.ndarray) -> np.ndarray:
    """Per layer: mean GPU load / max GPU load of ``loads [L, G]`` (1.0 for a layer with no
    tokens)."""
    loads = np.asarray(loads, dtype=np.float64)
    top = loads.max(axis=1)
    out = np.ones(loads.shape[0])
    busy = top > 0
    out[busy] = loads[busy].mean(axis=1) / top[busy]
    return out


def check_ep_size(num_experts: int, num_gpus: int) -> None:
    """ValueError naming ``--ep-size`` unless ``num_gpus`` divides ``num_experts`` (expert
    parallelism needs it; checked before anything else about the layout, so that no other
    suggestion leads to a size this refuses)."""
    if num_gpus < 1 or num_experts % num_gpus:
        divisors = [g for g in range(1, num_experts + 1) if num_experts % g == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ValueError(
            f"{num_experts} experts do not divide over --ep-size {num_gpus} GPUs (expert "
            f"parallelism needs it); pass a divisor of {num_experts}: {shown}"
        )


def check_redundancy(num_experts: int, num_gpus: int, redundant: int, option: str) -> None:
    """Bound the redundant experts ``option`` asks for before any plan is computed: at most
    :data:`~nemo_moe_metrics.config.limits.REDUNDANCY` per logical expert and
    :data:`~nemo_moe_metrics.config.limits.PER_GPU` per GPU (a plan computes one EPLB placement per
    redundant expert per GPU); ValueError naming the limit and its variable."""
    if redundant < 0:
        raise ValueError(f"{option} must be >= 0, got {redundant}")
    for limit, per, unit in (
        (REDUNDANCY, num_experts, f"{num_experts} experts"),
        (PER_GPU, num_gpus, f"{num_gpus} GPUs"),
    ):
        most = limit.value * per
        if redundant > most:
            raise LimitError(
                f"{option} {redundant:,} is above the limit of {most:,} ({limit.value} "
                f"{limit.what} x {unit}; {limit.why}); pass at most {most:,}, or raise the "
                f"limit with {limit.env}=N"
            )


def contiguous_placement(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """Today's placement without redundant experts: expert ``e`` on GPU ``e // (E/G)``."""
    check_ep_size(num_experts, num_gpus)
    return np.broadcast_to(np.arange(num_experts), (num_layers, num_experts)).copy()


def _replica_counts(physical_to_logical: np.ndarray, num_logical: int) -> np.ndarray:
    layers = physical_to_logical.shape[0]
    count = np.zeros((layers, num_logical), np.int64)
    np.add.at(count, (np.arange(layers)[:, None], physical_to_logical), 1)
    return count


def extend_placement(
    physical_to_logical: np.ndarray, num_logical: int, num_gpus: int
) -> np.ndarray:
    """One more slot per GPU, chosen so that no GPU's load changes where that is possible.

    Two kinds of copy move no token: another replica of an expert whose replicas are all on
    one GPU, placed on that GPU; or, for an expert with one replica on each of its GPUs, one
    more replica on each of them (each still gets ``1/c`` of its tokens). GPUs are covered by
    such experts greedily (:func:`_neutral_cover`); a GPU left over gets another replica of
    the expert with the largest share of its replicas on it (its load grows a little).
    """
    layers, physical = physical_to_logical.shape
    per_gpu = physical // num_gpus
    slots = physical_to_logical.reshape(layers, num_gpus, per_gpu)
    on_gpu = _replicas_on_gpus(physical_to_logical, num_logical, num_gpus)
    share = on_gpu / np.maximum(on_gpu.sum(axis=1), 1)[:, None, :]
    extra = np.argmax(share, axis=2)  # the fallback: the largest share, per GPU
    holders = on_gpu > 0  # [L, G, E]
    n_holders = holders.sum(axis=1)  # [L, E]
    whole = n_holders == 1
    spread = (on_gpu.max(axis=1) == 1) & (n_holders > 1)
    for layer in range(layers):
        _neutral_cover(extra[layer], holders[layer], n_holders[layer], whole[layer], spread[layer])
    return np.concatenate([slots, extra[:, :, None]], axis=2).reshape(layers, -1)


def _neutral_cover(
    extra: np.ndarray,
    holders: np.ndarray,
    n_holders: np.ndarray,
    whole: np.ndarray,
    spread: np.ndarray,
) -> None:
    """Write into ``extra [G]`` a neutral expert for as many GPUs as a greedy cover finds:
    GPUs without a wholly-held expert first take a spread expert (all of its GPUs free), the
    others a wholly-held one, what is left spread experts again."""
    num_gpus = holders.shape[0]
    free = np.ones(num_gpus, bool)
    spread_ids = np.nonzero(spread)[0]
    spread_ids = spread_ids[np.argsort(n_holders[spread_ids], kind="stable")]

    def take_spread(gpu: int | None) -> None:
        for e in spread_ids.tolist():
            gpus = np.nonzero(holders[:, e])[0]
            if (gpu is None or holders[gpu, e]) and free[gpus].all():
                extra[gpus] = e
                free[gpus] = False
                if gpu is not None:
                    return

    has_whole = (holders & whole[None, :]).any(axis=1)
    for gpu in np.nonzero(~has_whole)[0].tolist():
        if free[gpu]:
            take_spread(gpu)
    for gpu in np.nonzero(free & has_whole)[0].tolist():
        extra[gpu] = int(np.nonzero(holders[gpu] & whole)[0][0])
        free[gpu] = False
    if free.any():
        take_spread(None)


def monotone_placements(
    weight: np.ndarray, redundant_experts: int, groups: int, nodes: int, num_gpus: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(R', physical_to_logical [L, E+R'], from_fewer [L] bool)`` for ``R' = R mod G,
    R mod G + G, ..., R``: per layer, the better of EPLB with ``R'`` redundant experts and
    the placement for ``R' - G`` extended by one slot per GPU (:func:`extend_placement`).
    EPLB is greedy: with more replicas it is sometimes a little less balanced; this keeps
    every layer at least as balanced as EPLB, and no less balanced than with fewer copies
    whenever :func:`extend_placement` finds a copy that moves no token for every GPU (in our
    tests always up to ``R = E``)."""
    weight = np.asarray(weight)
    layers, experts = weight.shape
    best: np.ndarray | None = None
    for r in range(redundant_experts % num_gpus, redundant_experts + 1, num_gpus):
        eplb = rebalance_experts(weight, experts + r, groups, nodes, num_gpus).physical_to_logical
        if best is None:
            best, fewer = eplb, np.zeros(layers, bool)
        else:
            grown = extend_placement(best, experts, num_gpus)
            fewer = balancedness(gpu_loads(weight, grown, num_gpus)) > balancedness(
                gpu_loads(weight, eplb, num_gpus)
            )
            best = np.where(fewer[:, None], grown, eplb)
        yield r, best, fewer


@dataclass(frozen=True)
class PlacementPlan:
    """An EPLB plan for the layers ``layer_ids`` and what it changes."""

    layer_ids: np.ndarray  # [L] global layer ids (0-based)
    weight: np.ndarray  # [L, E] the loads it was planned from
    ep_size: int
    redundant_experts: int
    groups: int
    nodes: int
    physical_to_logical: np.ndarray  # [L, E + R]
    replica_count: np.ndarray  # [L, E]
    loads_before: np.ndarray  # [L, G] contiguous placement
    loads_after: np.ndarray  # [L, G] the plan
    from_fewer: np.ndarray  # [L] bool: a layer's plan grew from one with fewer replicas
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def policy(self) -> str:
        """``hierarchical`` or ``global``, as the reference decides (one group on one node is
        the global policy: the hierarchical one computes exactly that there)."""
        hierarchical = uses_hierarchical_policy(self.groups, self.nodes)
        return "hierarchical" if hierarchical and (self.groups, self.nodes) != (1, 1) else "global"

    @property
    def balancedness_before(self) -> np.ndarray:
        """Per layer, the contiguous placement's balancedness."""
        return balancedness(self.loads_before)

    @property
    def balancedness_after(self) -> np.ndarray:
        """Per layer, the plan's balancedness."""
        return balancedness(self.loads_after)

    @property
    def expert_time_ratio(self) -> float:
        """Expected time of the expert part with the plan over today's (sum over layers of the
        busiest GPU's load); 1.0 when no layer has tokens."""
        before = float(self.loads_before.max(axis=1).sum())
        return float(self.loads_after.max(axis=1).sum()) / before if before > 0 else 1.0

    @property
    def ideal_time_ratio(self) -> float:
        """The same ratio for perfect balance (every GPU at the mean): the bound of any plan."""
        before = float(self.loads_before.max(axis=1).sum())
        return float(self.loads_before.mean(axis=1).sum()) / before if before > 0 else 1.0

    def copies(self) -> list[list[tuple[int, int]]]:
        """Per layer, ``(expert, replicas)`` of the experts with more than one replica,
        most replicas first."""
        out = []
        for row in self.replica_count:
            hot = np.nonzero(row > 1)[0]
            out.append(sorted(((int(e), int(row[e])) for e in hot), key=lambda t: (-t[1], t[0])))
        return out

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (``layers``, ``physical_to_logical``,
        ``balancedness_before``, ``balancedness_after``, ...)."""
        return {
            "layers": self.layer_ids.tolist(),
            "num_logical_experts": int(self.weight.shape[1]),
            "num_physical_experts": int(self.physical_to_logical.shape[1]),
            "ep_size": self.ep_size,
            "redundant_experts": self.redundant_experts,
            "groups": self.groups,
            "nodes": self.nodes,
            "policy": self.policy,
            "physical_experts_per_gpu": int(self.physical_to_logical.shape[1] // self.ep_size),
            "physical_to_logical": self.physical_to_logical.tolist(),
            "replica_count": self.replica_count.tolist(),
            "balancedness_before": [round(float(b), 6) for b in self.balancedness_before],
            "balancedness_after": [round(float(b), 6) for b in self.balancedness_after],
            "expert_time_ratio": round(self.expert_time_ratio, 6),
            "ideal_expert_time_ratio": round(self.ideal_time_ratio, 6),
            "copies": [[list(c) for c in layer] for layer in self.copies()],
            "grown_from_fewer_replicas": self.from_fewer.tolist(),
            "source": self.source,
        }


def build_plan(
    weight: np.ndarray,
    layer_ids: np.ndarray,
    *,
    ep_size: int,
    redundant_experts: int = 0,
    groups: int = 1,
    nodes: int = 1,
    source: dict[str, Any] | None = None,
) -> PlacementPlan:
    """EPLB's plan for ``weight [L, E]`` and the contiguous placement it replaces."""
    weight = np.asarray(weight)
    layers, experts = weight.shape
    check_ep_size(experts, ep_size)
    check_redundancy(experts, ep_size, redundant_experts, "--redundant-experts")
    physical = experts + redundant_experts
    check_layout(experts, physical, groups, nodes, ep_size)
    before = contiguous_placement(layers, experts, ep_size)
    *_, (_, p2l, fewer) = monotone_placements(weight, redundant_experts, groups, nodes, ep_size)
    return PlacementPlan(
        layer_ids=np.asarray(layer_ids, dtype=np.int64),
        weight=weight,
        ep_size=ep_size,
        redundant_experts=redundant_experts,
        groups=groups,
        nodes=nodes,
        physical_to_logical=p2l,
        replica_count=_replica_counts(p2l, experts),
        loads_before=gpu_loads(weight, before, ep_size),
        loads_after=gpu_loads(weight, p2l, ep_size),
        from_fewer=fewer,
        source=dict(source or {}),
    )


@dataclass(frozen=True)
class SweepRow:
    """Balancedness per layer with ``redundant_experts`` copies (``plan`` is the plan)."""

    redundant_experts: int
    balancedness: np.ndarray  # [L]
    expert_time_ratio: float


def sweep_redundancies(num_experts: int, ep_size: int, most: int | None = None) -> list[int]:
    """``R = 0, G, 2G, ...`` up to ``most`` (default: ``E``, one extra copy per expert on
    average, or as far as :data:`~nemo_moe_metrics.config.limits.PER_GPU` allows ``G`` GPUs)."""
    most = min(num_experts, PER_GPU.value * max(ep_size, 1)) if most is None else most
    check_ep_size(num_experts, ep_size)
    check_redundancy(num_experts, ep_size, most, "--sweep-max")
    return list(range(0, most + 1, ep_size))


def sweep(
    weight: np.ndarray,
    *,
    ep_size: int,
    groups: int = 1,
    nodes: int = 1,
    most: int | None = None,
) -> list[SweepRow]:
    """Balancedness per layer for ``R = 0, G, 2G, ...`` up to ``most`` (default ``E``), each
    row at least as balanced per layer as EPLB and as the row before (monotone in ``R``)."""
    weight = np.asarray(weight)
    layers, experts = weight.shape
    rs = sweep_redundancies(experts, ep_size, most)
    check_layout(experts, experts + rs[-1], groups, nodes, ep_size)
    before = gpu_loads(weight, contiguous_placement(layers, experts, ep_size), ep_size)
    top_before = float(before.max(axis=1).sum())
    rows = []
    for r, p2l, _ in monotone_placements(weight, rs[-1], groups, nodes, ep_size):
        loads = gpu_loads(weight, p2l, ep_size)
        ratio = float(loads.max(axis=1).sum()) / top_before if top_before > 0 else 1.0
        rows.append(SweepRow(r, balancedness(loads), ratio))
    return rows
