"""An independent numpy (float64) computation of the router-health keys, for the tests.

It takes what a router itself produced in each forward, recorded by the tests' own hooks: its
logits, the experts it chose (its returned indices or routing map, never a top-k recomputed
here), its expert bias and padding. Gaps use a masked min over the chosen experts and a masked
max over the others, not a sorted top-(k+1) as the code under test does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

NEAR_TIE_GAP = 0.01


@dataclass
class Router:
    """How the router under test decides (the test states it; the code reads it itself)."""

    score: str  # "softmax" or "sigmoid"
    num_experts: int
    topk: int
    groups: int | None = None
    group_topk: int | None = None
    group_k: int = 2  # best experts summed into a group's score
    rank_on_logits: bool = False  # group scores from logits (softmax without pre-softmax)


def _allowed(rank: np.ndarray, r: Router) -> np.ndarray:
    if not r.groups:
        return np.ones_like(rank, dtype=bool)
    t, e = rank.shape
    grouped = rank.reshape(t, r.groups, e // r.groups)
    group_scores = -np.sort(-grouped, axis=-1)[..., : r.group_k].sum(-1)
    keep = np.zeros((t, r.groups), dtype=bool)
    for i in range(t):
        keep[i, np.argsort(-group_scores[i], kind="stable")[: r.group_topk]] = True
    return np.repeat(keep, e // r.groups, axis=1)


@dataclass
class Layer:
    """Per-token values of one layer over a step's forwards."""

    confidence: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    gap: list = field(default_factory=list)
    abs_max: list = field(default_factory=list)
    squares: list = field(default_factory=list)
    overlap: list = field(default_factory=list)
    micro: list = field(default_factory=list)

    def add(self, r: Router, logits, chosen, bias=None, valid=None) -> None:
        """One forward: ``logits`` [T, E], ``chosen`` [T, E] bool (the router's experts)."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1, r.num_experts)
        chosen = np.asarray(chosen, dtype=bool).reshape(-1, r.num_experts)
        keep = np.ones(len(z), bool) if valid is None else np.asarray(valid, bool).reshape(-1)
        counts = chosen[keep].sum(0)
        if counts.sum():
            self.micro.append(counts.max() * r.num_experts / counts.sum())
        z, chosen = z[keep], chosen[keep]
        if r.score == "softmax":
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            base = p
        else:
            base = 1.0 / (1.0 + np.exp(-z))
            p = base / base.sum(1, keepdims=True)
        b = 0.0 if bias is None else np.asarray(bias, dtype=np.float64)
        s = base + b
        rank = z if r.rank_on_logits and bias is None else s
        allowed = _allowed(rank, r)
        last_in = np.where(chosen, s, np.inf).min(1)
        first_out = np.where(allowed & ~chosen, s, -np.inf).max(1)
        self.gap += list((last_in - first_out) / np.abs(last_in))
        self.confidence += list((p * chosen).sum(1))
        self.entropy += list(-(p * np.log(p)).sum(1) / math.log(r.num_experts))
        self.abs_max.append(np.abs(z).max() if len(z) else 0.0)
        self.squares += list((z * z).mean(1))
        if bias is not None:
            unbiased = np.where(_allowed(base, r), base, -np.inf)
            top = np.argsort(-unbiased, axis=1, kind="stable")[:, : r.topk]
            self.overlap += [chosen[i, top[i]].sum() / r.topk for i in range(len(z))]

    def merge(self, other: Layer) -> None:
        """Add another rank's tokens and forwards (a reduction over ranks)."""
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def values(self) -> dict[str, float]:
        """The per-layer keys (without the ``moe/layer_{i}/`` prefix)."""
        gap = np.asarray(self.gap)
        out = {
            "router_confidence": float(np.mean(self.confidence)),
            "router_entropy": float(np.mean(self.entropy)),
            "router_topk_relative_gap": float(gap.mean()),
            "router_near_tie_fraction": float((gap < NEAR_TIE_GAP).mean()),
            "router_logit_max_abs": float(max(self.abs_max)),
            "router_logit_rms": float(np.sqrt(np.mean(self.squares))),
            "max_over_ideal_microbatch": float(np.mean(self.micro)),
        }
        if self.overlap:
            out["expert_bias_topk_overlap"] = float(np.mean(self.overlap))
        return out


def summaries(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    """The summary keys from per-layer values, as the issue defines them."""

    def col(stat):
        return [v[stat] for v in per_layer.values() if stat in v]

    out = {
        "moe/router_confidence": np.mean(col("router_confidence")),
        "moe/router_confidence_min": min(col("router_confidence")),
        "moe/router_entropy": np.mean(col("router_entropy")),
        "moe/router_topk_relative_gap": np.mean(col("router_topk_relative_gap")),
        "moe/router_near_tie_fraction": np.mean(col("router_near_tie_fraction")),
        "moe/router_near_tie_fraction_max": max(col("router_near_tie_fraction")),
        "moe/router_logit_max_abs": max(col("router_logit_max_abs")),
        "moe/router_logit_rms": np.mean(col("router_logit_rms")),
        "moe/max_over_ideal_microbatch": np.mean(col("max_over_ideal_microbatch")),
    }
    if col("expert_bias_topk_overlap"):
        out["moe/expert_bias_topk_overlap"] = np.mean(col("expert_bias_topk_overlap"))
    return {k: float(v) for k, v in out.items()}


def expected_keys(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    """Every router-health key (summaries and ``moe/layer_{i}/...``) the step should log."""
    out = summaries(per_layer)
    for layer, values in per_layer.items():
        out.update({f"moe/layer_{layer}/{k}": v for k, v in values.items()})
    return out


def assert_matches(logged: dict, expected: dict[str, float], *, tokens: int) -> None:
    """Every expected key logged with the expected value; near-tie shares within one token."""
    import pytest

    health = {k for k in logged if "router_" in k or "microbatch" in k or "bias_topk" in k}
    assert health == set(expected), (sorted(health ^ set(expected)), "differ")
    for key, value in expected.items():
        if "near_tie" in key:  # a float32 gap right at the threshold may fall either side
            assert logged[key] == pytest.approx(value, abs=1.0 / tokens + 1e-12), key
        else:
            assert logged[key] == pytest.approx(value, rel=2e-5, abs=1e-6), key
