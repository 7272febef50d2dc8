"""Routing consistency: the rollout engine's expert choices against the training router's.

Pure tensor arithmetic, free of ``torch.distributed``: the router hooks (``moe.collector``) call
:meth:`RoutingTracker.observe` with device tensors, the reduction (``moe.reduction``) sums
:meth:`RoutingTracker.local_stats` over ranks, and :func:`routing_metrics` turns the summed
integers into the ``moe/routing_*`` keys on the host.

Definitions (over the step's training forwards; a *pair* is a (token, MoE layer) the training
router saw, padding it knows of excluded; a pair *has a route* when its rollout row holds
``top_k`` distinct experts in ``[0, num_experts)``; ``-1`` marks none; an id outside
``[-1, num_experts)`` on a real token is an error at export, and so are routes that no
training forward used, e.g. given after the forward). A ratio over no pairs is not logged:

- ``moe/routing_disagreement``: pairs with a route whose top-k set chosen by the training
  router (from its own scores, also under router replay) differs from the rollout's set, over
  pairs with a route (order ignored).
- ``moe/routing_topk_overlap``: mean of ``|rollout set & training set| / top_k`` over pairs
  with a route.
- ``moe/routing_tokens_any_layer_differs``: tokens routed on every MoE layer of the forward
  whose sets differ on at least one layer, over those tokens.
- ``moe/routing_missing_fraction``: pairs without a route over all pairs.
- ``moe/routing_replay_mismatch`` (only when router replay ran): pairs with a route whose
  executed experts (the routing map the dispatcher received) differ from the rollout's set,
  over the pairs with a route seen under replay.

Every accumulator is an int64 device tensor; nothing here reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nemo_moe_metrics import metric_names as mn

#: Per-layer integer slots of :meth:`RoutingTracker.local_stats`; ``OUT_OF_RANGE``: real
#: tokens whose rollout row holds an id outside ``[-1, num_experts)`` (an error at export).
PAIRS, ROUTED, DIFFER, OVERLAP, REPLAY_PAIRS, REPLAY_MISMATCH, REPLAY_FORWARDS, OUT_OF_RANGE = (
    range(8)
)
LAYER_SLOTS = 8
#: Step-wide slots after the per-layer block: tokens routed on every layer, of which differ,
#: and routes given to ``microbatch()`` that no training forward used (an error at export).
TOKENS_ALL_ROUTED, TOKENS_ANY_DIFFERS, UNUSED_ROUTES = range(3)
GLOBAL_SLOTS = 3


class RoutingShapeError(ValueError):
    """``rollout_routes`` does not fit the microbatch or the model."""


def normalize_routes(
    routes: torch.Tensor,
    *,
    num_moe_layers: int,
    topk: int,
    sequence_major: bool,
    num_sequences: int | None = None,
) -> torch.Tensor:
    """``[tokens, moe_layers, top_k]`` int64 in the router's token order, checked on shapes only.

    Accepts packed ``[tokens, moe_layers, top_k]`` (the microbatch's tokens in model order,
    packed sequences concatenated) or padded ``[batch, seq, moe_layers, top_k]``. Padded input
    becomes the router's order: sequence-major ``[seq * batch]`` for megatron-core routers,
    batch-major ``[batch * seq]`` for Hugging Face routers. Raises :class:`RoutingShapeError`
    naming both shapes; reads no value (no host sync).
    """
    if not isinstance(routes, torch.Tensor):
        routes = torch.as_tensor(routes)
    expected = f"[tokens, {num_moe_layers}, {topk}] or [batch, seq, {num_moe_layers}, {topk}]"
    shape = tuple(routes.shape)
    if routes.dim() not in (3, 4) or shape[-2:] != (num_moe_layers, topk):
        what = (
            f"{shape[-2]} MoE layers"
            if routes.dim() in (3, 4) and shape[-2] != num_moe_layers
            else "a different layout"
        )
        raise RoutingShapeError(
            f"rollout_routes has shape {shape} ({what}) but the model expects {expected} "
            f"(MoE layers in model order, top-{topk}); pass the engine's routed_experts for this "
            "microbatch's tokens"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise RoutingShapeError(f"rollout_routes must hold integer expert ids, got {routes.dtype}")
    if routes.dim() == 4:
        b = shape[0]
        if num_sequences is not None and b != num_sequences:
            raise RoutingShapeError(
                f"rollout_routes has shape {shape} ({b} sequences) but seq_lens has "
                f"{num_sequences} sequences; pass one row of routes per sequence"
            )
        routes = routes.transpose(0, 1) if sequence_major else routes
        routes = routes.reshape(-1, num_moe_layers, topk)
    return routes.to(torch.int64)


def indices_to_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, k]`` expert ids (``-1`` ignored) as a boolean ``[T, E]`` membership map."""
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < num_experts)
    out = torch.zeros(idx.shape[0], num_experts + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(ok, idx, num_experts), True)
    return out[:, :num_experts]


def compare(
    rollout: torch.Tensor, chosen_map: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether the rollout row is a route, and ``|rollout set & chosen set|``.

    ``rollout`` ``[T, k]`` int64 (``-1`` or out-of-range ids: no route), ``chosen_map``
    ``[T, E]`` bool. A row with a repeated expert id is not a route either (a set of k).
    """
    k = rollout.shape[1]
    in_range = (rollout >= 0) & (rollout < num_experts)
    safe = torch.where(in_range, rollout, 0)
    # k distinct ids: each id equals only itself among the row's k ([T, k, k], k is small).
    distinct = (safe.unsqueeze(2) == safe.unsqueeze(1)).sum(dim=(1, 2)) == k
    valid = in_range.all(dim=1) & distinct
    overlap = chosen_map.gather(1, safe).sum(dim=1)
    return valid, torch.where(valid, overlap, 0)


class RoutingTracker:
    """Device accumulators of one rank's routing comparison for one step.

    ``layer_ids``: this rank's hooked MoE layers (global ids, ascending); ``moe_layers``: every
    MoE layer of the model in model order (global ids), whose position is the layer axis of
    the rollout routes.
    """

    def __init__(
        self,
        layer_ids: Sequence[int],
        moe_layers: Sequence[int],
        topk: int,
        num_experts: Sequence[int],
        device: torch.device,
        *,
        sequence_major: bool,
        rollout_experts: int = 0,
    ) -> None:
        """See the class docstring; ``sequence_major``: megatron-core token order;
        ``rollout_experts`` > 0 also counts the rollout's own expert choices per layer in that
        many columns (``moe/rollout_max_over_ideal``, with ``track_router_health``)."""
        missing = sorted(set(layer_ids) - set(moe_layers))
        if missing:
            raise ValueError(f"router layers {missing} are not among the MoE layers {moe_layers}")
        self.layer_ids = list(layer_ids)
        self.moe_layers = list(moe_layers)
        self.topk = topk
        self.sequence_major = sequence_major
        self._row = {layer: i for i, layer in enumerate(self.layer_ids)}
        self._axis = {layer: self.moe_layers.index(layer) for layer in self.layer_ids}
        self._experts = dict(zip(self.layer_ids, num_experts, strict=True))
        self.stats = torch.zeros(len(self.layer_ids), LAYER_SLOTS, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(GLOBAL_SLOTS, dtype=torch.int64, device=device)
        self.rollout_counts = (
            torch.zeros(len(self.layer_ids), rollout_experts, dtype=torch.int64, device=device)
            if rollout_experts
            else None
        )
        self._routes: torch.Tensor | None = None
        self._routes_used = False  # a host flag: a training forward saw the routes
        # Per token of the current forward: layers with a route, layers that differ.
        self._routed_layers: torch.Tensor | None = None
        self._differ_layers: torch.Tensor | None = None

    # -- per microbatch --------------------------------------------------------------------
    def set_routes(self, routes: torch.Tensor | None, num_sequences: int | None = None) -> None:
        """The next training forward's rollout routes (None: that forward has no routes)."""
        self._check_routes_used()
        self.fold()
        if routes is not None:
            routes = normalize_routes(
                routes,
                num_moe_layers=len(self.moe_layers),
                topk=self.topk,
                sequence_major=self.sequence_major,
                num_sequences=num_sequences,
            )
            if routes.device != self.stats.device:
                routes = routes.to(self.stats.device, non_blocking=True)
        self._routes = routes
        self._routes_used = False

    def _check_routes_used(self) -> None:
        # Counted, not raised: the export raises on every rank together (no rank left waiting
        # in a collective), from the summed count.
        if self._routes is not None and not self._routes_used:
            self._routes = None
            self.tokens[UNUSED_ROUTES] += 1  # a device op with a host number: no sync

    def fold(self) -> None:
        """Add the finished forward's per-token flags to the step's token counts."""
        if self._routed_layers is None:
            return
        all_routed = self._routed_layers == len(self.layer_ids)
        differs = all_routed & (self._differ_layers > 0)
        self.tokens[TOKENS_ALL_ROUTED] += all_routed.sum()
        self.tokens[TOKENS_ANY_DIFFERS] += differs.sum()
        self._routed_layers = self._differ_layers = None

    # -- per router forward (hot path: device ops only) -------------------------------------
    def observe(
        self,
        layer_id: int,
        chosen_map: torch.Tensor,
        executed_map: torch.Tensor,
        valid_tokens: torch.Tensor | None,
        replay: bool,
    ) -> None:
        """One router forward: its own top-k choice and its executed map, both ``[T, E]`` bool.

        ``valid_tokens`` ``[T]`` bool (False = padding the router knows of) or None.
        """
        row = self._row[layer_id]
        num_tokens = chosen_map.shape[0]
        stats = self.stats[row]
        if stats.device != chosen_map.device:  # the model moved after attach
            self._move(chosen_map.device)
            stats = self.stats[row]
        real = (
            torch.ones(num_tokens, dtype=torch.bool, device=chosen_map.device)
            if valid_tokens is None
            else valid_tokens.reshape(-1).bool()
        )
        if self._routes is None:
            stats[PAIRS] += real.sum()
            return
        if self._routes.shape[0] != num_tokens:
            raise RoutingShapeError(
                f"rollout_routes has shape {tuple(self._routes.shape)} ({self._routes.shape[0]} "
                f"tokens) but MoE layer {layer_id}'s router saw {num_tokens} tokens; pass routes "
                "for exactly the microbatch's tokens (padding included, as -1)"
            )
        self._routes_used = True
        rollout = self._routes[:, self._axis[layer_id]]
        experts = self._experts[layer_id]
        has_route, overlap = compare(rollout, chosen_map, experts)
        has_route = has_route & real
        differ = has_route & (overlap < self.topk)
        stats[OUT_OF_RANGE] += (((rollout < -1) | (rollout >= experts)).any(dim=1) & real).sum()
        stats[PAIRS] += real.sum()
        stats[ROUTED] += has_route.sum()
        stats[DIFFER] += differ.sum()
        stats[OVERLAP] += torch.where(has_route, overlap, 0).sum()
        if self.rollout_counts is not None:
            # The engine's own load: rows without a full route (-1, e.g. the last generated
            # token) and padding are left out; fixed-size scatter, no host read.
            ids = torch.where((rollout >= 0) & (rollout < experts), rollout, 0)
            taken = has_route.unsqueeze(1).expand_as(ids).to(torch.int64)
            self.rollout_counts[row].scatter_add_(0, ids.reshape(-1), taken.reshape(-1))
        if replay:
            _, executed_overlap = compare(rollout, executed_map, experts)
            exact = executed_overlap == self.topk
            exact &= executed_map.sum(dim=1) == self.topk
            stats[REPLAY_PAIRS] += has_route.sum()
            stats[REPLAY_MISMATCH] += (has_route & ~exact).sum()
            stats[REPLAY_FORWARDS] += 1
        if self._routed_layers is None or self._routed_layers.shape[0] != num_tokens:
            self.fold()
            self._routed_layers = torch.zeros(num_tokens, dtype=torch.int64, device=real.device)
            self._differ_layers = torch.zeros_like(self._routed_layers)
        assert self._differ_layers is not None
        self._routed_layers += has_route
        self._differ_layers += differ

    def _move(self, device: torch.device) -> None:
        self.stats = self.stats.to(device)
        self.tokens = self.tokens.to(device)
        if self.rollout_counts is not None:
            self.rollout_counts = self.rollout_counts.to(device)
        if self._routes is not None:
            self._routes = self._routes.to(device)

    # -- step boundary ---------------------------------------------------------------------
    def local_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([local layers, LAYER_SLOTS], [GLOBAL_SLOTS])`` int64 device tensors (folded)."""
        self._check_routes_used()
        self.fold()
        return self.stats, self.tokens

    def reset(self) -> None:
        """Zero the step's accumulators and forget any routes (start of a new step)."""
        self.stats.zero_()
        self.tokens.zero_()
        if self.rollout_counts is not None:
            self.rollout_counts.zero_()
        self._routes = None
        self._routes_used = False
        self._routed_layers = self._differ_layers = None


def _put_ratio(out: dict[str, Any], key: str, num: float, den: float) -> None:
    # A ratio over no pairs is undefined: no key (a gap on the dashboard), never 0 (agreement).
    if den:
        out[key] = float(num) / float(den)


def routing_metrics(
    layer_ids: Sequence[int],
    stats: np.ndarray,
    tokens: np.ndarray,
    topk: int,
    *,
    per_layer: bool,
) -> dict[str, Any]:
    """The ``moe/routing_*`` keys from summed integers (``stats`` ``[layers, LAYER_SLOTS]``).

    Exact ratios of integer sums. A ratio whose denominator is 0 (no pair with a route, no
    pair at all) is left out, never reported as 0. The replay key appears only when some router
    forward ran under router replay in the step. Expert ids out of range raise ``ValueError``,
    unused routes :class:`RoutingShapeError` (the same sums, so the same error on every rank).
    """
    stats = np.asarray(stats, dtype=np.int64).reshape(len(layer_ids), LAYER_SLOTS)
    total = stats.sum(axis=0)
    if tokens[UNUSED_ROUTES]:
        raise RoutingShapeError(
            f"rollout_routes passed to microbatch() were never used ({int(tokens[UNUSED_ROUTES])} "
            "time(s), all ranks): no training forward ran between that microbatch() call and "
            "the next one or finish_step. Pass a microbatch's routes to microbatch() before its "
            "forward, inside `with metrics.step():`; routes given after the forward would be "
            "compared with the next microbatch's tokens"
        )
    if total[OUT_OF_RANGE]:
        bad = [
            f"layer {la}: {int(row[OUT_OF_RANGE])}"
            for la, row in zip(layer_ids, stats, strict=True)
            if row[OUT_OF_RANGE]
        ]
        raise ValueError(
            f"rollout_routes hold expert ids outside [-1, num_experts) for "
            f"{int(total[OUT_OF_RANGE])} (token, MoE layer) pair(s) ({', '.join(bad[:5])}): "
            "routes are expert indices 0..num_experts-1 per MoE layer in model order, -1 where "
            "no route was captured; check the engine's routed_experts layout and layer order"
        )
    out: dict[str, Any] = {}
    _put_ratio(out, mn.ROUTING_DISAGREEMENT, total[DIFFER], total[ROUTED])
    _put_ratio(out, mn.ROUTING_TOPK_OVERLAP, total[OVERLAP], total[ROUTED] * topk)
    _put_ratio(
        out,
        mn.ROUTING_TOKENS_ANY_LAYER_DIFFERS,
        tokens[TOKENS_ANY_DIFFERS],
        tokens[TOKENS_ALL_ROUTED],
    )
    _put_ratio(out, mn.ROUTING_MISSING_FRACTION, total[PAIRS] - total[ROUTED], total[PAIRS])
    if total[REPLAY_FORWARDS] > 0:
        _put_ratio(out, mn.ROUTING_REPLAY_MISMATCH, total[REPLAY_MISMATCH], total[REPLAY_PAIRS])
    if per_layer:
        for layer, row in zip(layer_ids, stats, strict=True):
            key = mn.routing_layer_key(layer, "routing_disagreement")
            _put_ratio(out, key, row[DIFFER], row[ROUTED])
            key = mn.routing_layer_key(layer, "routing_topk_overlap")
            _put_ratio(out, key, row[OVERLAP], row[ROUTED] * topk)
    return out


def route_memory_bytes(tokens: int, moe_layers: int, topk: int, itemsize: int = 8) -> int:
    """Device bytes of one microbatch's routes ``[tokens, moe_layers, top_k]`` (int64: 8)."""
    return tokens * moe_layers * topk * itemsize
