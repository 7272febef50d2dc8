"""Router decision health: how confident and how fragile each MoE layer's routing decisions are.

Pure tensor arithmetic, free of ``torch.distributed``: the router hooks (``moe.collector``) hand
a router forward's own logits (captured where the router computes them, ``adapters``) to
``moe.health_tracker``, which judges them with :func:`decision_table`; the reduction
(``moe.reduction``) sums the per-layer sums over ranks inside the export's one host read, and
:func:`router_health_metrics` turns them into the ``moe/...router_*`` keys on the host.

Definitions, per MoE layer and per token the router saw in a training forward (padding it knows
of excluded). ``z`` the router's logits (the gating output, before the score function and any
expert bias); ``p`` the routing probabilities: ``softmax(z)``, or ``f(z) / sum(f(z))`` for
sigmoid (``f = sigmoid``) and sqrt-softplus routers; ``s`` the selection scores the router ranks:
``p`` for softmax routers, ``f(z)`` for the others, plus the expert bias where the router has
one (``z`` + bias for a router that adds it to its logits), restricted to the chosen groups for
group-limited routers (chosen as the router does).
``S`` is the top-k of ``s``: the router's own decision (under router replay or capacity
dropping the executed experts can differ; ``moe/routing_replay_mismatch`` and
``moe/dropped_fraction`` say by how much). ``s_k`` is the lowest selection score in ``S``,
``s_k+1`` the highest outside it.

- ``router_confidence``: mean of ``sum(p[e] for e in S)``;
- ``router_entropy``: mean of ``H(p) / ln(E)``, ``E`` the classes ``p`` spans (the routed
  experts, and the zero-computation ones of a router that ranks those too);
- ``router_topk_relative_gap``: mean of ``(s_k - s_k+1) / |s_k|``;
- ``router_near_tie_fraction``: share of tokens whose relative gap is below the
  ``router_near_tie_gap`` threshold;
- ``router_logit_max_abs`` (max of ``|z|``) and ``router_logit_rms`` (``sqrt(mean z^2)``);
- ``expert_bias_topk_overlap`` (routers with an expert bias): mean of
  ``|S & topk(scores without the bias)| / top_k`` (experts tied at the k-th unbiased score
  all count as in that top-k);
- ``max_over_ideal_microbatch``: mean over router forwards (microbatches, ranks) of each
  forward's own ``max(c) * E / sum(c)`` over its routed counts ``c``.

Every accumulator lives on the router's device; nothing here reads a value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.deferred import softmax

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")

#: Per-layer float64 slots of ``health_tracker.RouterHealthTracker.sums`` (sums over tokens or
#: forwards).
(
    TOKENS,
    CONFIDENCE,
    ENTROPY,
    GAP,
    NEAR_TIE,
    GAP_TOKENS,
    LOGIT_SQUARES,
    BIASED_TOKENS,
    BIAS_OVERLAP,
    MICRO_RATIO,
    MICRO_FORWARDS,
) = range(11)
SLOTS = 11
DECISION_SLOTS = 9  # TOKENS .. BIAS_OVERLAP: what a router forward with logits adds
_TINY = torch.finfo(torch.float32).tiny  # the logits are judged in float32


@dataclass(frozen=True)
class RouterScoring:
    """How one router turns logits into its decision (static per layer).

    ``num_experts``: the classes the router ranks (its logits' width: the routed experts, plus
    zero-computation experts where it ranks those too).
    ``rank_on_logits``: a router that ranks its logits (megatron-core softmax without
    ``moe_router_pre_softmax``, transformers routers that take the top-k of ``z``); the same
    top-k as ranking ``f(z)``, but group scores differ. ``bias_on_logits``: the router adds its
    expert bias to the logits, so ``s = z + bias`` (transformers' Kolibri).
    ``num_groups`` / ``group_topk``: group-limited routing (``group_topk`` of ``num_groups``
    equal groups kept per token); a group's score is the sum of its best
    ``group_score_topk`` selection scores (megatron-core: ``topk // group_topk``;
    DeepSeek-V3 in transformers and torchtitan: 2; DeepSeek-V2: 1, the best). The experts of
    the other groups score ``group_masked_score`` (``-inf``: never chosen; DeepSeek-V2 and
    A.X-K2 in transformers fill 0, which a negative biased score ranks below).
    """

    score_function: str
    num_experts: int
    topk: int
    rank_on_logits: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int = 2
    bias_on_logits: bool = False
    group_masked_score: float = float("-inf")

    def __post_init__(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"router score function {self.score_function!r} is not one of {SCORE_FUNCTIONS}"
            )
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"top-k {self.topk} must be in [1, num_experts={self.num_experts}]")
        if self.grouped:
            assert self.num_groups is not None and self.group_topk is not None
            if self.num_experts % self.num_groups or not 1 <= self.group_topk <= self.num_groups:
                raise ValueError(
                    f"group-limited routing: {self.num_experts} experts in {self.num_groups} "
                    f"groups keeping {self.group_topk}; the groups must divide the experts"
                )

    @property
    def grouped(self) -> bool:
        """Whether the router restricts each token to some groups of experts."""
        return bool(self.num_groups) and bool(self.group_topk)

    @property
    def choosable_experts(self) -> int:
        """Experts a token can be routed to (those of its chosen groups, unless the others keep
        a finite score the router still ranks)."""
        if not self.grouped or math.isfinite(self.group_masked_score):
            return self.num_experts
        assert self.num_groups is not None and self.group_topk is not None
        return self.group_topk * (self.num_experts // self.num_groups)

    @property
    def gap_defined(self) -> bool:
        """A top-k gap needs an expert the router could have chosen but did not."""
        return self.choosable_experts > self.topk


def _group_drop(ranked: torch.Tensor, scoring: RouterScoring) -> torch.Tensor:
    """``[..., groups, 1]`` bool: the groups each token does not keep, chosen as the router does."""
    assert scoring.num_groups is not None and scoring.group_topk is not None
    grouped = ranked.unflatten(-1, (scoring.num_groups, -1))
    per_group = min(scoring.group_score_topk, grouped.shape[-1])
    group_scores = grouped.topk(per_group, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(scoring.group_topk, dim=-1, sorted=False)[1]
    drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, chosen, False)
    return drop.unsqueeze(-1)


def _masked(scores: torch.Tensor, drop: torch.Tensor, fill: float) -> torch.Tensor:
    """``scores`` ``[..., E]`` with the experts of the dropped groups at ``fill``."""
    grouped = scores.unflatten(-1, (drop.shape[-2], -1))
    return grouped.masked_fill(drop, fill).flatten(-2)


def _rank(
    ranked: torch.Tensor, selection: torch.Tensor, scoring: RouterScoring, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [..., k] of the k best experts, best first; the selection scores as ranked)``.

    ``ranked`` is what the router takes the top-k of (``selection``, or the logits, which order
    the experts the same way); the gap is measured on the second tensor: ``selection`` with
    the experts outside the chosen groups at ``group_masked_score``.
    """
    if not scoring.grouped:
        return ranked.topk(k, dim=-1)[1], selection
    drop = _group_drop(ranked, scoring)
    fill = scoring.group_masked_score
    masked = _masked(ranked, drop, fill)
    if ranked is selection:
        measured = masked
    elif math.isinf(fill):  # the top-(k+1) are all inside the chosen groups
        measured = selection
    else:
        measured = _masked(selection, drop, fill)
    return masked.topk(k, dim=-1)[1], measured


def _scores(
    z: torch.Tensor, scoring: RouterScoring, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p, sum(p log p) per token, f(z) or p (the unbiased scores), s)`` of float32 logits
    ``[..., E]``; ``bias`` broadcasts against them (``[E]``, or ``[N, 1, E]`` for a batch of
    forwards ``[N, T, E]``)."""
    if scoring.score_function == "softmax":
        log_p = softmax(z, log=True)
        p = log_p.exp()
        entropy = torch.linalg.vecdot(p, log_p)
        base = p
    else:
        base = (
            torch.sigmoid(z)
            if scoring.score_function == "sigmoid"
            else torch.nn.functional.softplus(z).sqrt()
        )
        p = base / base.sum(dim=-1, keepdim=True)
        # p log p, 0 where p is 0: on a CPU half the time of xlogy (a p below the clamp adds
        # under 1e-36 either way)
        entropy = torch.linalg.vecdot(p, p.clamp_min(_TINY).log())
    selection = base if bias is None else (z if scoring.bias_on_logits else base) + bias
    return p, entropy, base, selection


def _ranked(
    z: torch.Tensor,
    base: torch.Tensor,
    selection: torch.Tensor,
    scoring: RouterScoring,
    biased: bool,
) -> torch.Tensor:
    # Softmax and sigmoid are monotone: ranking logits picks the same experts (and is what the
    # router's group scores are computed on); the gap itself is measured on `selection`.
    return z if scoring.rank_on_logits and not biased else selection


def _expert_bias(bias: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One forward's expert bias as ``[E]`` on the logits' device and dtype (ernie4_5_moe keeps
    it ``[1, E]``)."""
    return bias.detach().reshape(-1).to(like.device, like.dtype)


def chosen_experts(
    logits: torch.Tensor, scoring: RouterScoring, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``[T, top_k]``: the experts ``scoring`` says the router chooses, best first.

    The top-k of the selection scores :func:`decision_sums` judges; a scoring describes its
    router right when these are the indices the router itself returns (tests check it for every
    family they describe).
    """
    with torch.no_grad():
        z = logits.detach().reshape(-1, scoring.num_experts).float()
        bias = None if bias is None else _expert_bias(bias, z)
        _, _, base, selection = _scores(z, scoring, bias)
        ranked = _ranked(z, base, selection, scoring, bias is not None)
        return _rank(ranked, selection, scoring, scoring.topk)[0]


def decision_table(
    z: torch.Tensor,
    scoring: RouterScoring,
    near_tie_gap: float,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    padded: bool,
    chosen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor]:
    """``(per-token table [T, n], the slot of each column, |z| max per token [T])`` of router
    forwards of one scoring, their tokens' float32 logits ``z`` ``[T, E]`` concatenated.

    One pass over every token given, as few device ops as the definitions allow (each is a
    kernel launch, and on a CPU its Python dispatch, whatever the batch holds): the entropy
    column is ``sum(p log p)`` and the logit column ``sum(z^2)``, unscaled (:func:`slot_scale`
    finishes both). ``bias`` ``[E]`` or per token ``[T, E]``, or None; ``weight`` ``[T]``
    float32, 0 on padding rows (``padded``: some row may be 0, so every column is weighted).
    ``chosen``: the routers' own top-k as a ``[T, E]`` bool map or ``[T, k]`` int64 expert ids
    (ungrouped scorings), which replaces ranking the scores here (a top-k over ``E`` is the
    costliest op of the pass).
    """
    k = scoring.topk
    p, entropy, base, selection = _scores(z, scoring, bias)
    gap_defined = scoring.gap_defined
    if chosen is not None and not scoring.grouped and chosen.dtype != torch.bool:
        # The routers' own expert ids [T, k]: s_k, the lowest chosen score; s_k+1, the
        # highest other one
        at_chosen = p.gather(-1, chosen)
        confidence = at_chosen.sum(dim=-1)
        edge = None
        if gap_defined:
            at_chosen = at_chosen if selection is p else selection.gather(-1, chosen)
            edge = (at_chosen.amin(dim=-1), selection.scatter(-1, chosen, -math.inf).amax(dim=-1))
        order = None
    elif chosen is not None and not scoring.grouped:
        confidence = torch.where(chosen, p, 0.0).sum(dim=-1)
        edge = None
        if gap_defined:  # s_k, the lowest chosen score; s_k+1, the highest other one
            edge = (
                torch.where(chosen, selection, math.inf).amin(dim=-1),
                torch.where(chosen, -math.inf, selection).amax(dim=-1),
            )
        order = None
    else:
        ranked = _ranked(z, base, selection, scoring, bias is not None)
        order, measured = _rank(ranked, selection, scoring, k + 1 if gap_defined else k)
        if measured is p:  # one gather serves the confidence and the gap
            picked = p.gather(-1, order)
            confidence = picked[..., :k].sum(dim=-1)
            edge = picked[..., k - 1 :].unbind(-1) if gap_defined else None
        else:
            confidence = p.gather(-1, order[..., :k]).sum(dim=-1)
            edge = (
                measured.gather(-1, order[..., k - 1 : k + 1]).unbind(-1) if gap_defined else None
            )
    columns = [weight, confidence, entropy, torch.linalg.vecdot(z, z)]
    slots: tuple[int, ...] = (TOKENS, CONFIDENCE, ENTROPY, LOGIT_SQUARES)
    if edge is not None:
        last_in, first_out = edge
        # Unbiased scores are >= 0 (p, sigmoid, sqrt-softplus): |s_k| is s_k, one op less.
        size = last_in if bias is None else last_in.abs()
        gap = (last_in - first_out) / size.clamp_min(_TINY)
        columns += [gap, gap < near_tie_gap, weight]  # stack promotes the bool column
        slots += (GAP, NEAR_TIE, GAP_TOKENS)
    if bias is not None:
        unbiased_ranked = z if scoring.rank_on_logits else base
        if order is not None and scoring.grouped:  # the unbiased choice picks its groups first
            unbiased = _rank(unbiased_ranked, unbiased_ranked, scoring, k)[0]
            shared = (order[..., :k].unsqueeze(-1) == unbiased.unsqueeze(-2)).any(-1).sum(-1)
        else:  # a chosen expert is in the unbiased top-k when fewer than k score above it
            # (a [T, k, E] compare: on a CPU several times cheaper than a second topk)
            if order is not None:
                ids = order[..., :k]
            else:
                ids = chosen if chosen.dtype != torch.bool else chosen_ids(chosen, k)
            at_chosen = unbiased_ranked.gather(-1, ids)
            above = (unbiased_ranked.unsqueeze(-2) > at_chosen.unsqueeze(-1)).sum(dim=-1)
            shared = (above < k).sum(dim=-1)
        columns += [weight, shared]  # stack promotes the int64 column
        slots += (BIASED_TOKENS, BIAS_OVERLAP)
    table = torch.stack(columns, dim=-1)
    # abs + amax: on a CPU about 10x faster than vector_norm(inf)
    magnitude = z.abs().amax(dim=-1)
    if padded:
        table = table * weight.unsqueeze(-1)
        magnitude = magnitude * weight
    return table, slots, magnitude


def chosen_ids(chosen: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` expert ids of a ``[T, E]`` bool map with ``k`` experts per row, ascending.

    Each expert's slot is its rank among the chosen (or, after them, among the others): a
    permutation of ``[0, E)`` per row, so one scatter without colliding writes.
    """
    rank = chosen.cumsum(dim=-1)
    experts = torch.arange(chosen.shape[-1], device=chosen.device)
    slot = torch.where(chosen, rank - 1, (experts + k) - rank)
    return torch.empty_like(rank).scatter_(-1, slot, experts.expand_as(rank))[..., :k]


def slot_scale(scoring: RouterScoring) -> list[float]:
    """Per slot, the factor that turns a layer's raw sums into :data:`SLOTS` sums: ``1/ln(E)``
    for the entropy (``H(p) / ln(E)``, ``E`` this router's classes, which the layout's experts
    may not be), ``1/E`` for the squared logits (a per-token mean), 1 elsewhere."""
    experts = scoring.num_experts
    scale = [1.0] * SLOTS
    scale[ENTROPY] = 1.0 / math.log(experts) if experts > 1 else 0.0
    scale[LOGIT_SQUARES] = 1.0 / experts
    return scale


def decision_sums(
    logits: torch.Tensor,
    scoring: RouterScoring,
    *,
    near_tie_gap: float,
    bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One router forward's sums over its tokens: ``([DECISION_SLOTS] float64, max |z|)``.

    ``logits`` ``[..., E]`` (any leading token shape), ``bias`` ``[E]`` (the expert bias the
    router adds to its selection scores) or None, ``valid`` (``[tokens]`` bool, False =
    padding) or None. Device ops only; no value is read on the host. The entropy slot holds
    ``sum(p log p) / ln(E)`` and the overlap slot ``|S & unbiased top-k|``:
    :func:`router_health_metrics` negates the one and divides the other by ``top_k``, on the
    host. (``health_tracker.RouterHealthTracker`` runs the same arithmetic over its kept forwards.)
    """
    with torch.no_grad():
        z = logits.detach().reshape(-1, scoring.num_experts).float()
        if valid is None:
            weight = torch.ones(z.shape[0], dtype=torch.float32, device=z.device)
        else:
            weight = valid.reshape(-1).to(device=z.device, dtype=torch.float32)
        bias = None if bias is None else _expert_bias(bias, z)
        table, slots, magnitude = decision_table(
            z, scoring, near_tie_gap, bias, weight, valid is not None
        )
        sums = torch.zeros(DECISION_SLOTS, dtype=torch.float64, device=z.device)
        index = torch.tensor(slots, dtype=torch.int64, device=z.device)
        sums.index_add_(0, index, table.sum(dim=0, dtype=torch.float64))
        scale = torch.tensor(slot_scale(scoring)[:DECISION_SLOTS], dtype=torch.float64)
        max_abs = magnitude.amax() if z.shape[0] else torch.zeros((), device=z.device)
    return sums * scale.to(sums.device), max_abs


def microbatch_balance(counts: torch.Tensor) -> torch.Tensor:
    """``[max(c) * E / sum(c), 1]`` of one forward's routed counts ``[E]``; zeros if empty."""
    return forwards_balance(counts.reshape(1, -1)).sum(dim=0)


def forwards_balance(counts: torch.Tensor) -> torch.Tensor:
    """``[F, 2]``: per forward (a row of routed counts ``[F, E]``), ``max(c) * E / sum(c)``
    and 1, or zeros for a forward that routed nothing."""
    c = counts.to(torch.float64)
    total = c.sum(dim=1)
    routed = total > 0
    ratio = torch.where(routed, c.amax(dim=1) * c.shape[1] / total, 0.0)
    return torch.stack([ratio, routed.to(torch.float64)], dim=1)


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def router_health_metrics(
    layer_ids: Sequence[int],
    sums: np.ndarray,
    max_abs: np.ndarray,
    *,
    topks: Sequence[int],
    per_layer: bool,
) -> dict[str, Any]:
    """The router-health keys from sums reduced over ranks (``sums`` ``[layers, SLOTS]``).

    ``topks`` (per layer) finish the overlap normalisation.

    A layer contributes to a summary only when it measured that quantity this step (a router
    whose score function is unknown, a layer without an expert bias, a top-k without a gap);
    a summary no layer measured is left out, never reported as 0.
    """
    sums = np.asarray(sums, dtype=np.float64).reshape(len(layer_ids), SLOTS)
    values: dict[str, dict[int, float]] = {stat: {} for stat in mn.ROUTER_HEALTH_LAYER_STATS}
    peaks = np.asarray(max_abs).reshape(-1)
    for layer, row, peak, topk in zip(layer_ids, sums, peaks, topks, strict=True):
        tokens = row[TOKENS]
        if tokens > 0:
            values["router_confidence"][layer] = row[CONFIDENCE] / tokens
            values["router_entropy"][layer] = -row[ENTROPY] / tokens
            values["router_logit_max_abs"][layer] = float(peak)
            values["router_logit_rms"][layer] = math.sqrt(row[LOGIT_SQUARES] / tokens)
        if row[GAP_TOKENS] > 0:
            values["router_topk_relative_gap"][layer] = row[GAP] / row[GAP_TOKENS]
            values["router_near_tie_fraction"][layer] = row[NEAR_TIE] / row[GAP_TOKENS]
        if row[BIASED_TOKENS] > 0:
            overlap = row[BIAS_OVERLAP] / row[BIASED_TOKENS] / topk
            values["expert_bias_topk_overlap"][layer] = overlap
        if row[MICRO_FORWARDS] > 0:
            values["max_over_ideal_microbatch"][layer] = row[MICRO_RATIO] / row[MICRO_FORWARDS]
    out: dict[str, Any] = {}
    summaries = {
        mn.ROUTER_CONFIDENCE: ("router_confidence", _mean),
        mn.ROUTER_CONFIDENCE_MIN: ("router_confidence", min),
        mn.ROUTER_ENTROPY: ("router_entropy", _mean),
        mn.ROUTER_TOPK_RELATIVE_GAP: ("router_topk_relative_gap", _mean),
        mn.ROUTER_NEAR_TIE_FRACTION: ("router_near_tie_fraction", _mean),
        mn.ROUTER_NEAR_TIE_FRACTION_MAX: ("router_near_tie_fraction", max),
        mn.ROUTER_LOGIT_MAX_ABS: ("router_logit_max_abs", max),
        mn.ROUTER_LOGIT_RMS: ("router_logit_rms", _mean),
        mn.EXPERT_BIAS_TOPK_OVERLAP: ("expert_bias_topk_overlap", _mean),
        mn.MAX_OVER_IDEAL_MICROBATCH: ("max_over_ideal_microbatch", _mean),
    }
    for key, (stat, reduce) in summaries.items():
        if values[stat]:
            out[key] = float(reduce(list(values[stat].values())))
    if per_layer:
        for stat, by_layer in values.items():
            for layer, value in by_layer.items():
                out[mn.router_health_layer_key(layer, stat)] = float(value)
    return out


def rollout_balance_metrics(
    layer_ids: Sequence[int], counts: np.ndarray, *, per_layer: bool
) -> dict[str, Any]:
    """``moe/rollout_max_over_ideal`` from the rollout engine's own routes, summed over ranks.

    ``counts`` ``[layers, E]``: per MoE layer, the experts the rollout chose for the step's
    training tokens (rows holding a ``-1`` left out). A layer without any route is left out.
    """
    counts = np.asarray(counts, dtype=np.float64).reshape(len(layer_ids), -1)
    ratios: dict[int, float] = {}
    for layer, c in zip(layer_ids, counts, strict=True):
        total = c.sum()
        if total > 0:
            ratios[layer] = float(c.max() * c.size / total)
    out: dict[str, Any] = {}
    if ratios:
        out[mn.ROLLOUT_MAX_OVER_IDEAL] = _mean(list(ratios.values()))
    if per_layer:
        for layer, ratio in ratios.items():
            out[mn.router_health_layer_key(layer, "rollout_max_over_ideal")] = ratio
    return out
