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

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.deferred import FLUSH_BYTES, ConstantTensors

#: Per-layer integer slots of :meth:`RoutingTracker.local_stats`; ``OUT_OF_RANGE``: real
#: tokens whose rollout row holds an id outside ``[-1, num_experts)`` (an error at export).
PAIRS, ROUTED, DIFFER, OVERLAP, REPLAY_PAIRS, REPLAY_MISMATCH, REPLAY_FORWARDS, OUT_OF_RANGE = (
    range(8)
)
LAYER_SLOTS = 8
#: Step-wide slots after the per-layer block: tokens routed on every layer, of which differ,
#: routes given to ``microbatch()`` that no training forward used, and routes written in place
#: before the step compared them (both errors at export).
TOKENS_ALL_ROUTED, TOKENS_ANY_DIFFERS, UNUSED_ROUTES, MODIFIED_ROUTES = range(4)
GLOBAL_SLOTS = 4


class RoutingShapeError(ValueError):
    """``rollout_routes`` does not fit the microbatch or the model."""


def check_routes(
    routes: Any,
    *,
    num_moe_layers: int,
    topk: int,
    num_sequences: int | None = None,
) -> torch.Tensor:
    """``routes`` as a tensor, its shape and dtype checked; no device op, no value read.

    Accepts packed ``[tokens, moe_layers, top_k]`` (the microbatch's tokens in model order,
    packed sequences concatenated) or padded ``[batch, seq, moe_layers, top_k]`` integer ids
    (:func:`in_router_order` puts either in the router's token order). Raises
    :class:`RoutingShapeError` naming both shapes.
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
    if routes.dim() == 4 and num_sequences is not None and shape[0] != num_sequences:
        raise RoutingShapeError(
            f"rollout_routes has shape {shape} ({shape[0]} sequences) but seq_lens has "
            f"{num_sequences} sequences; pass one row of routes per sequence"
        )
    return routes


def route_tokens(routes: torch.Tensor) -> int:
    """The tokens a checked ``routes`` tensor (:func:`check_routes`) holds routes for."""
    return routes.shape[0] if routes.dim() == 3 else routes.shape[0] * routes.shape[1]


def in_router_order(routes: torch.Tensor, *, sequence_major: bool) -> torch.Tensor:
    """``[M, tokens, moe_layers, top_k]`` int64 in the router's token order, of ``M``
    microbatches' checked routes stacked (``[M, tokens, ...]`` or ``[M, batch, seq, ...]``).

    Padded routes become sequence-major ``[seq * batch]`` for megatron-core routers and
    batch-major ``[batch * seq]`` for Hugging Face routers.
    """
    if routes.dim() == 5:
        routes = routes.transpose(1, 2) if sequence_major else routes
        routes = routes.reshape(routes.shape[0], -1, *routes.shape[-2:])
    return routes.to(torch.int64)


def indices_to_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, k]`` expert ids (``-1`` ignored) as a boolean ``[T, E]`` membership map."""
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < num_experts)
    out = torch.zeros(idx.shape[0], num_experts + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(ok, idx, num_experts), True)
    return out[:, :num_experts]


def route_checks(routes: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(is a route, holds an out-of-range id)``, bool ``[...]``, of rollout rows ``[..., k]``.

    A row is a route when its ``k`` ids are distinct and in ``[0, num_experts)``; an id below
    ``-1`` or at least ``num_experts`` is out of range (``-1`` marks no route). Elementwise
    over the rows: one call checks every layer of a microbatch's ``[T, layers, k]`` routes.
    """
    k = routes.shape[-1]
    below = routes < num_experts
    valid = ((routes >= 0) & below).all(dim=-1)
    # k distinct ids: no pair equal (k (k - 1) / 2 row-sized compares, no [..., k, k] tensor).
    for i in range(k - 1):
        valid &= ~(routes[..., i + 1 :] == routes[..., i : i + 1]).any(dim=-1)
    out_of_range = ((routes < -1) | ~below).any(dim=-1)
    return valid, out_of_range


def _overlap(rollout: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``|rollout set & chosen set|`` per token (meaningful where the rollout row is a route);
    any leading shape (``[T, k]`` rows, or ``[N, T, k]`` for N forwards)."""
    # An out-of-range row is no route whatever its clamped ids say.
    safe = rollout.clamp(0, num_experts - 1)
    if chosen.dtype == torch.bool:
        return chosen.gather(-1, safe).sum(dim=-1)
    # ids: membership of each rollout id among the router's ([T, k, k'], no [T, E] map)
    return (safe.unsqueeze(-1) == chosen.unsqueeze(-2)).any(dim=-1).sum(dim=-1)


def compare(
    rollout: torch.Tensor, chosen: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether the rollout row is a route, and ``|rollout set & chosen set|``.

    ``rollout`` ``[T, k]`` int64 (``-1`` or out-of-range ids: no route); ``chosen`` the
    training router's experts, a ``[T, E]`` bool map or ``[T, k']`` integer ids (compared
    directly, no map built; ids outside ``[0, E)`` match nothing). A row with a repeated expert
    id is not a route either (a set of k).
    """
    valid, _ = route_checks(rollout, num_experts)
    return valid, _overlap(rollout, chosen, num_experts) * valid


class RoutingTracker:
    """Device accumulators of one rank's routing comparison for one step.

    ``layer_ids``: this rank's hooked MoE layers (global ids, ascending); ``moe_layers``: every
    MoE layer of the model in model order (global ids), whose position is the layer axis of
    the rollout routes.

    A forward's choice is kept, not compared at once: a finished microbatch's forwards wait with
    its routes, and :meth:`local_stats` (or ``deferred.FLUSH_BYTES`` of them) compares them in
    one pass, every microbatch of the same shape and layers together.
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
        self._constants = ConstantTensors()
        experts = set(num_experts)
        self._uniform_experts = experts.pop() if len(experts) == 1 else None
        # The current microbatch's forwards, by kind, until it ends: (row, chosen, executed,
        # real tokens or None).
        self._kept: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor, Any]]] = {}
        # Finished microbatches, kept for the batched comparison: (routes, their version
        # counter when given, their forwards).
        self._finished: list[tuple[torch.Tensor, int, dict[tuple, list]]] = []
        self._finished_bytes = 0
        self._routes: torch.Tensor | None = None
        self._route_version = 0  # the routes' version counter when given (a host int)
        self._routes_used = False  # a host flag: a training forward saw the routes

    # -- per microbatch --------------------------------------------------------------------
    def set_routes(self, routes: torch.Tensor | None, num_sequences: int | None = None) -> None:
        """The next training forward's rollout routes (None: that forward has no routes)."""
        self._check_routes_used()
        self.fold()
        if routes is not None:
            # Checked now, put in the router's order (a copy) by the batched pass: the routes
            # must not be written before then, which their version counter (a host int) tells.
            routes = check_routes(
                routes,
                num_moe_layers=len(self.moe_layers),
                topk=self.topk,
                num_sequences=num_sequences,
            )
            if routes.device != self.stats.device:
                routes = routes.to(self.stats.device, non_blocking=True)
            self._route_version = routes._version
        self._routes = routes
        self._routes_used = False

    def _check_routes_used(self) -> None:
        # Counted, not raised: the export raises on every rank together (no rank left waiting
        # in a collective), from the summed count.
        if self._routes is not None and not self._routes_used:
            self._routes = None
            self._kept = {}
            self.tokens[UNUSED_ROUTES] += 1  # a device op with a host number: no sync

    def fold(self) -> None:
        """Keep the finished microbatch's forwards (with its routes) for the batched pass;
        compare what is kept once it holds :data:`FLUSH_BYTES`."""
        if not self._kept:
            return
        assert self._routes is not None
        self._finished.append((self._routes, self._route_version, self._kept))
        self._finished_bytes += self._routes.numel() * self._routes.element_size()
        for forwards in self._kept.values():
            self._finished_bytes += sum(f[1].numel() * f[1].element_size() for f in forwards)
        self._kept = {}
        if self._finished_bytes >= FLUSH_BYTES:
            self._compare_finished()

    # -- per router forward (hot path: shape checks, kept for the batched pass) -------------
    def observe(
        self,
        layer_id: int,
        chosen: torch.Tensor,
        executed_map: torch.Tensor,
        valid_tokens: torch.Tensor | None,
        replay: bool,
    ) -> None:
        """One router forward: its own top-k choice and the experts it executed.

        ``chosen``: a ``[T, E]`` bool map or ``[T, k]`` expert ids (compared directly);
        ``executed_map``: ``[T, E]`` bool (read under router replay only) or, where the router
        executes its own choice, the same tensor as ``chosen``. ``valid_tokens`` ``[T]`` bool
        (False = padding the router knows of) or None. Kept until the microbatch ends, when
        every layer's forward is compared in one pass.
        """
        row = self._row[layer_id]
        num_tokens = chosen.shape[0]
        if self.stats.device != chosen.device:  # the model moved after attach
            self._move(chosen.device)
        real = None if valid_tokens is None else valid_tokens.reshape(-1).bool()
        if self._routes is None:
            self.stats[row, PAIRS] += num_tokens if real is None else real.sum()
            return
        if route_tokens(self._routes) != num_tokens:
            raise RoutingShapeError(
                f"rollout_routes has shape {tuple(self._routes.shape)} ("
                f"{route_tokens(self._routes)} tokens) but MoE layer {layer_id}'s router saw "
                f"{num_tokens} tokens; pass routes for exactly the microbatch's tokens "
                "(padding included, as -1)"
            )
        self._routes_used = True
        key = (chosen.dtype, chosen.shape[1], self._experts[layer_id], real is None, replay)
        self._kept.setdefault(key, []).append((row, chosen, executed_map, real))

    def _compare_finished(self) -> None:
        """Compare every kept microbatch with its routes: in one pass when they share their
        shape and layers (the usual step), else one pass per microbatch."""
        microbatches, self._finished, self._finished_bytes = self._finished, [], 0
        finished = []
        for routes, version, kept in microbatches:
            if routes._version != version:  # counted: the export raises on every rank
                self.tokens[MODIFIED_ROUTES] += 1
            else:
                finished.append((routes, kept))
        layouts = {
            (
                routes.shape,
                routes.dtype,
                tuple((k, tuple(f[0] for f in fw)) for k, fw in kept.items()),
            )
            for routes, kept in finished
        }
        order = self.sequence_major
        if len(finished) > 1 and len(layouts) == 1:
            merged: dict[tuple, list] = {}
            for _, kept in finished:
                for kind, forwards in kept.items():
                    merged.setdefault(kind, []).extend(forwards)
            stacked = torch.stack([routes for routes, _ in finished])
            self._compare(in_router_order(stacked, sequence_major=order), merged)
            return
        for routes, kept in finished:
            self._compare(in_router_order(routes.unsqueeze(0), sequence_major=order), kept)

    def _compare(self, routes: torch.Tensor, kept: dict[tuple, list]) -> None:
        """Compare ``M`` microbatches' routes ``[M, T, layers, k]`` with their kept forwards
        (per kind of forward, microbatch-major: ``M`` times the same layers)."""
        microbatches = routes.shape[0]
        checked = None
        if self._uniform_experts is not None:  # every layer checked in one call
            checked = route_checks(routes, self._uniform_experts)
        routed_layers = differ_layers = None  # per microbatch and token [M, T]
        for (_, _, experts, unpadded, replay), forwards in kept.items():
            rows = [f[0] for f in forwards[: len(forwards) // microbatches]]
            device = self.stats.device
            index = self._constants.index(rows, device)
            axes = self._constants.index([self._axis[self.layer_ids[r]] for r in rows], device)
            # [M, N, T, k] and [M, N, T]: microbatch, layer forward, token.
            rollout = routes.index_select(2, axes).transpose(1, 2)
            has_route, out_of_range = (
                route_checks(rollout, experts)
                if checked is None
                else (c.index_select(2, axes).transpose(1, 2) for c in checked)
            )
            chosen = self._stacked([f[1] for f in forwards], microbatches)
            overlap = _overlap(rollout, chosen, experts) * has_route
            if unpadded:
                pairs = self._constants.ones(has_route.shape, torch.bool, device)
            else:
                pairs = self._stacked([f[3] for f in forwards], microbatches)
                has_route = has_route & pairs
                overlap = overlap * pairs
                out_of_range = out_of_range & pairs
            differ = has_route & (overlap < self.topk)
            columns = [pairs, has_route, differ, overlap, out_of_range]
            slots = (PAIRS, ROUTED, DIFFER, OVERLAP, OUT_OF_RANGE)
            if replay:
                executed = self._stacked([f[2] for f in forwards], microbatches)
                _, executed_overlap = compare(rollout, executed, experts)
                exact = (executed_overlap == self.topk) & (executed.sum(dim=-1) == self.topk)
                columns += [has_route, has_route & ~exact]
                slots += (REPLAY_PAIRS, REPLAY_MISMATCH)
            # Per microbatch, forward and token [M, N, T, n], summed once into the slots.
            added = torch.stack(columns, dim=-1).sum(dim=(0, 2))
            self.stats.index_put_(
                (index.unsqueeze(1), self._constants.index(slots, device)), added, True
            )
            if replay:
                forwards_each = torch.full_like(index, microbatches)
                self.stats[:, REPLAY_FORWARDS].index_add_(0, index, forwards_each)
            if self.rollout_counts is not None:
                # The engine's own load: rows without a full route (-1, e.g. the last generated
                # token) and padding are left out; fixed-size scatter, no host read.
                ids = torch.where((rollout >= 0) & (rollout < experts), rollout, 0)
                ids = ids + (index * self.rollout_counts.shape[1]).reshape(1, -1, 1, 1)
                taken = has_route.unsqueeze(-1).expand_as(ids).to(torch.int64)
                self.rollout_counts.view(-1).scatter_add_(0, ids.reshape(-1), taken.reshape(-1))
            routed, differs = has_route.sum(dim=1), differ.sum(dim=1)
            if routed_layers is None or differ_layers is None:
                routed_layers, differ_layers = routed, differs
            else:
                routed_layers, differ_layers = routed_layers + routed, differ_layers + differs
        if routed_layers is None or differ_layers is None:
            return
        # Tokens routed on every layer of their forward, and of those, which differ anywhere.
        all_routed = routed_layers == len(self.layer_ids)
        flags = torch.stack([all_routed, all_routed & (differ_layers > 0)]).sum(dim=(1, 2))
        self.tokens[TOKENS_ALL_ROUTED : TOKENS_ANY_DIFFERS + 1] += flags

    @staticmethod
    def _stacked(tensors: list[torch.Tensor], microbatches: int) -> torch.Tensor:
        """``[M, N, ...]`` of ``M * N`` same-shaped tensors, microbatch-major."""
        return torch.stack(tensors).unflatten(0, (microbatches, -1))

    def _move(self, device: torch.device) -> None:
        self._compare_finished()  # on the old device (a model moves between steps, not inside)
        self.stats = self.stats.to(device)
        self.tokens = self.tokens.to(device)
        if self.rollout_counts is not None:
            self.rollout_counts = self.rollout_counts.to(device)
        if self._routes is not None:
            self._routes = self._routes.to(device)
            self._route_version = self._routes._version

    # -- step boundary ---------------------------------------------------------------------
    def local_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([local layers, LAYER_SLOTS], [GLOBAL_SLOTS])`` int64 device tensors (folded)."""
        self._check_routes_used()
        self.fold()
        self._compare_finished()
        return self.stats, self.tokens

    def reset(self) -> None:
        """Zero the step's accumulators and forget any routes (start of a new step)."""
        self.stats.zero_()
        self.tokens.zero_()
        if self.rollout_counts is not None:
            self.rollout_counts.zero_()
        self._routes = None
        self._routes_used = False
        self._kept, self._finished, self._finished_bytes = {}, [], 0


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
    if tokens[MODIFIED_ROUTES]:
        raise RoutingShapeError(
            f"rollout_routes passed to microbatch() were written in place before the step "
            f"compared them ({int(tokens[MODIFIED_ROUTES])} microbatch(es), all ranks): they are "
            "read at finish_step, not copied. Pass a tensor that stays as it is until the step "
            "ends (e.g. a slice of the rollout batch, or routes.clone() of a reused buffer)"
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
