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

    score: str  # "softmax", "sigmoid" or "sqrtsoftplus"
    num_experts: int  # the classes it ranks (zero-computation experts included)
    topk: int
    groups: int | None = None
    group_topk: int | None = None
    group_k: int = 2  # best experts summed into a group's score
    rank_on_logits: bool = False  # group scores from logits (softmax without pre-softmax)
    bias_on_logits: bool = False  # s = z + bias
    masked: float = -math.inf  # the score of an expert outside the kept groups


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


def _micro(counts: np.ndarray) -> float | None:
    return counts.max() * len(counts) / counts.sum() if counts.sum() else None


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

    def add(self, r: Router, logits, chosen, bias=None, valid=None, counts=None) -> None:
        """One forward: ``logits`` [T, E], ``chosen`` [T, E] bool (the router's experts);
        ``counts``: the routed experts' counts when they are not the chosen classes' (routers
        with zero-computation experts)."""
        z = np.asarray(logits, dtype=np.float64).reshape(-1, r.num_experts)
        chosen = np.asarray(chosen, dtype=bool).reshape(-1, r.num_experts)
        keep = np.ones(len(z), bool) if valid is None else np.asarray(valid, bool).reshape(-1)
        self.add_counts(chosen[keep].sum(0) if counts is None else np.asarray(counts))
        z, chosen = z[keep], chosen[keep]
        if r.score == "softmax":
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            base = p
        else:
            base = (
                1.0 / (1.0 + np.exp(-z)) if r.score == "sigmoid" else np.sqrt(np.log1p(np.exp(z)))
            )
            p = base / base.sum(1, keepdims=True)
        b = 0.0 if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
        s = (z if r.bias_on_logits and bias is not None else base) + b
        rank = z if r.rank_on_logits and bias is None else s
        ranked = np.where(_allowed(rank, r), s, r.masked)  # what the router ranks
        last_in = np.where(chosen, ranked, np.inf).min(1)
        first_out = np.where(~chosen, ranked, -np.inf).max(1)
        # |s_k| at least float32's smallest normal, as the code: a chosen score of exactly 0
        # (an expert outside the kept groups at a fill of 0) gives a 0 gap on a tie
        scale = np.maximum(np.abs(last_in), np.finfo(np.float32).tiny)
        self.gap += list((last_in - first_out) / scale)
        self.confidence += list((p * chosen).sum(1))
        self.entropy += list(-(p * np.log(p)).sum(1) / math.log(r.num_experts))
        self.abs_max.append(np.abs(z).max() if len(z) else 0.0)
        self.squares += list((z * z).mean(1))
        if bias is not None:
            plain = z if r.rank_on_logits else base
            unbiased = np.where(_allowed(plain, r), plain, r.masked)
            top = np.argsort(-unbiased, axis=1, kind="stable")[:, : r.topk]
            self.overlap += [chosen[i, top[i]].sum() / r.topk for i in range(len(z))]

    def add_counts(self, counts) -> None:
        """One forward's routed counts [E] (a router whose decisions are not judged adds only
        these)."""
        micro = _micro(np.asarray(counts, dtype=np.float64))
        if micro is not None:
            self.micro.append(micro)

    def merge(self, other: Layer) -> None:
        """Add another rank's tokens and forwards (a reduction over ranks)."""
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def values(self) -> dict[str, float]:
        """The per-layer keys (without the ``moe/layer_{i}/`` prefix)."""
        out = {"max_over_ideal_microbatch": float(np.mean(self.micro))} if self.micro else {}
        if not self.confidence:  # a router whose decisions are not judged
            return out
        gap = np.asarray(self.gap)
        out |= {
            "router_confidence": float(np.mean(self.confidence)),
            "router_entropy": float(np.mean(self.entropy)),
            "router_logit_max_abs": float(max(self.abs_max)),
            "router_logit_rms": float(np.sqrt(np.mean(self.squares))),
        }
        if len(gap):
            out["router_topk_relative_gap"] = float(gap.mean())
            out["router_near_tie_fraction"] = float((gap < NEAR_TIE_GAP).mean())
        if self.overlap:
            out["expert_bias_topk_overlap"] = float(np.mean(self.overlap))
        return out


def summaries(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    """The summary keys from per-layer values, as the issue defines them."""

    def col(stat):
        return [v[stat] for v in per_layer.values() if stat in v]

    summary = {  # key: (per-layer stat, reduction); a stat no layer measured is left out
        "moe/router_confidence": ("router_confidence", np.mean),
        "moe/router_confidence_min": ("router_confidence", min),
        "moe/router_entropy": ("router_entropy", np.mean),
        "moe/router_topk_relative_gap": ("router_topk_relative_gap", np.mean),
        "moe/router_near_tie_fraction": ("router_near_tie_fraction", np.mean),
        "moe/router_near_tie_fraction_max": ("router_near_tie_fraction", max),
        "moe/router_logit_max_abs": ("router_logit_max_abs", max),
        "moe/router_logit_rms": ("router_logit_rms", np.mean),
        "moe/max_over_ideal_microbatch": ("max_over_ideal_microbatch", np.mean),
        "moe/expert_bias_topk_overlap": ("expert_bias_topk_overlap", np.mean),
    }
    return {key: float(reduce(col(stat))) for key, (stat, reduce) in summary.items() if col(stat)}


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
