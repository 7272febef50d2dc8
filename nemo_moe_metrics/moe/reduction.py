"""The collectives for expert counts: agree on a layer signature once, then one summing all_reduce.

Global view: the union of all ranks' layers by global layer id. Ranks holding different tokens
(data, context, expert parallel, and tensor parallel with sequence parallel) are summed;
tensor-parallel replicas without sequence parallel count once (``contribute``); pipeline stages
hold different layers and meet in the union.

Every rank, with or without MoE layers, keeps one :class:`ExpertLoadReducer` per group and calls
:meth:`ExpertLoadReducer.export` at the same points. The first export gathers each rank's
signature (pipeline stage, and per layer its id, experts, top-k and whether it has
zero-computation experts) and validates it; a mismatch raises the same
:class:`ExpertLoadSignatureError` on every rank. Later exports make exactly one ``all_reduce`` of
routed counts, executed counts, routed tokens and zero-computation picks together, and no host read
of their own (:meth:`ExpertLoadReducer.enqueue` hands the result to the export's one read), with
guard slots that catch a rank whose layers changed since (re-attaching a collector to another
model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nemo_moe_metrics.export.host_read import Pending, collective_device, read_once
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.moe import router_health, routing
from nemo_moe_metrics.moe.balance import ExpertLoads

_GUARD = 2  # [participants, ranks whose signature changed]


class ExpertLoadSignatureError(RuntimeError):
    """Ranks disagree on which MoE layers exist or how many experts they have."""


class LayerSignature(NamedTuple):
    """One MoE layer as a rank sees it."""

    layer: int  #: global layer id
    experts: int  #: routed experts
    topk: int  #: experts per token
    zero_computation: bool = False  #: its router can pick zero-computation experts


@dataclass(frozen=True)
class Signature:
    """One rank's view: its pipeline stage and its MoE layers (none on a stage without MoE)."""

    stage: int
    layers: tuple[LayerSignature, ...]


@dataclass(frozen=True)
class Layout:
    """The agreed global MoE layers, in layer-id order (identical on every rank)."""

    layer_ids: list[int]
    experts: list[int]
    topks: list[int]
    zero_computation: list[bool]


def local_signature(collector: Any, stage: int) -> Signature:
    """The signature of a collector (or of a rank without MoE layers when it is None)."""
    if collector is None:
        return Signature(stage, ())
    layers = zip(
        collector.layer_ids,
        collector.num_experts,
        collector.topks,
        collector.zero_computation,
        strict=True,
    )
    return Signature(stage, tuple(LayerSignature(*layer) for layer in layers))


def check_signatures(signatures: list[Signature]) -> Layout:
    """Validate all ranks' signatures; returns the global layout.

    Rules: a layer id has one (experts, top-k, zero-computation) everywhere; ranks in the same
    pipeline stage hold the same layers; ranks in different stages hold disjoint layers. Layers
    may differ from each other in experts and top-k. Pure: every rank runs it on the same
    gathered list, so every rank raises the same error.
    """
    shapes: dict[int, dict[tuple, list[int]]] = {}
    for rank, sig in enumerate(signatures):
        for entry in sig.layers:
            shapes.setdefault(entry.layer, {}).setdefault(tuple(entry[1:]), []).append(rank)
    problems = []
    for layer in sorted(shapes):
        if len(shapes[layer]) > 1:
            variants = sorted(shapes[layer].items())
            same_k = len({k for (_, k, _), _ in variants}) == 1
            same_z = len({z for (_, _, z), _ in variants}) == 1
            seen = "; ".join(
                f"{e} experts{'' if same_k else f', top-{k}'}"
                f"{'' if same_z or not z else ', zero-computation experts'}"
                f"{'' if same_z or z else ', none zero-computation'}"
                f" on ranks {r}"
                for (e, k, z), r in variants
            )
            problems.append(f"layer {layer} has {seen}")
    by_stage: dict[int, dict[frozenset, list[int]]] = {}
    for rank, sig in enumerate(signatures):
        ids = frozenset(entry.layer for entry in sig.layers)
        by_stage.setdefault(sig.stage, {}).setdefault(ids, []).append(rank)
    for stage, groups in sorted(by_stage.items()):
        if len(groups) > 1:
            seen = "; ".join(f"ranks {r} hold layers {sorted(ids)}" for ids, r in groups.items())
            problems.append(f"pipeline stage {stage} ranks hold different MoE layers: {seen}")
    stage_layers = {s: set().union(*g) for s, g in by_stage.items()}
    stages = sorted(stage_layers)
    for i, a in enumerate(stages):
        for b in stages[i + 1 :]:
            common = stage_layers[a] & stage_layers[b]
            if common:
                problems.append(f"pipeline stages {a} and {b} both hold layers {sorted(common)}")
    if problems:
        raise ExpertLoadSignatureError(
            "expert-load export: ranks disagree on the MoE layer signature, refusing to sum "
            "unrelated layers: " + " | ".join(problems) + ". Every rank must attach the "
            "collector to the same model (its own pipeline stage's chunks) before the first export."
        )
    layer_ids = sorted(shapes)
    agreed = [next(iter(shapes[layer])) for layer in layer_ids]
    return Layout(
        layer_ids,
        [e for e, _, _ in agreed],
        [k for _, k, _ in agreed],
        [z for _, _, z in agreed],
    )


def default_stage() -> int:
    """This rank's pipeline stage from megatron-core's parallel state, else 0."""
    return compat.pipeline_stage()


def default_contribute(collector: Any) -> bool:
    """False on tensor-parallel replicas (TP rank > 0 without sequence parallel): count once."""
    if collector is None or collector.sequence_parallel:
        return True
    return not compat.tensor_parallel_replica()


def _world(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ExpertLoadReducer:
    """Reduces expert counts over one process group; holds the agreed layout between steps."""

    def __init__(self, group: Any = None, *, stage: int | None = None):
        """``group``: ranks to sum over (default world); ``stage``: pipeline stage override."""
        self.group = group
        self.stage = stage
        self._layout: Layout | None = None
        self._signature: Signature | None = None
        self._index: torch.Tensor | None = None
        self._index_on: dict[torch.device, torch.Tensor] = {}  # a host-to-device copy syncs
        self._size = 0

    @property
    def layer_ids(self) -> list[int]:
        """Global MoE layer ids agreed at the first export (empty before it)."""
        return list(self._layout.layer_ids) if self._layout is not None else []

    @property
    def num_experts(self) -> list[int]:
        """Experts of each agreed layer, in ``layer_ids`` order (empty before the first export)."""
        return list(self._layout.experts) if self._layout is not None else []

    @property
    def topks(self) -> list[int]:
        """Top-k of each agreed layer, in ``layer_ids`` order (empty before the first export)."""
        return list(self._layout.topks) if self._layout is not None else []

    def _agree(self, sig: Signature, world: int) -> None:
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, sig, group=self.group)
        else:
            gathered = [sig]
        layout = check_signatures(gathered)
        self._layout, self._signature = layout, sig
        offsets = np.concatenate([[0], np.cumsum(layout.experts)]).astype(np.int64)
        n_counts = int(offsets[-1])
        n_layers = len(layout.layer_ids)
        pos = {layer: i for i, layer in enumerate(layout.layer_ids)}
        # Where this rank's flat [routed counts of each local layer..., executed counts of each
        # local layer..., tokens of each local layer..., zero-computation picks of each local
        # layer...] land in the global payload [all routed counts..., all executed counts...,
        # all tokens..., all zero-computation picks..., guard].
        local = [int(offsets[pos[e.layer]]) + j for e in sig.layers for j in range(e.experts)]
        index = local + [n_counts + i for i in local]
        index += [2 * n_counts + pos[e.layer] for e in sig.layers]
        index += [2 * n_counts + n_layers + pos[e.layer] for e in sig.layers]
        self._index = torch.tensor(index, dtype=torch.int64)
        self._size = 2 * n_counts + 2 * n_layers + _GUARD

    def export(self, collector: Any, *, contribute: bool | None = None) -> ExpertLoads:
        """Sum this step's counts over the group, reset the collector, return the global loads."""
        return read_once([self.enqueue(collector, contribute=contribute)])[0]

    def enqueue(self, collector: Any, *, contribute: bool | None = None) -> Pending[ExpertLoads]:
        """Launch the step's summing ``all_reduce``; the returned Pending builds the loads.

        The first call also agrees on the layer signature (``all_gather_object``, its own
        host read, once per run). Finishing resets the collector.
        """
        world, _ = _world(self.group)
        stage = self.stage if self.stage is not None else default_stage()
        sig = local_signature(collector, stage)
        if self._layout is None:
            self._agree(sig, world)
        assert self._layout is not None and self._index is not None
        if contribute is None:
            contribute = default_contribute(collector)
        device = collective_device(self.group)
        payload = torch.zeros(self._size, dtype=torch.int64, device=device)
        changed = sig != self._signature
        if collector is not None and contribute and not changed and self._index.numel():
            flat = collector.local_payload(device)
            if device not in self._index_on:
                self._index_on[device] = self._index.to(device)
            payload.index_copy_(0, self._index_on[device], flat)
        payload[-2] = 1
        payload[-1] = int(changed)
        if world > 1:
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.group)
        return Pending((payload,), lambda host: self._finish(collector, world, host[0]))

    def _finish(self, collector: Any, world: int, values: np.ndarray) -> ExpertLoads:
        assert self._layout is not None
        layout = self._layout
        if collector is not None:
            collector.reset()
        if values[-2] != world or values[-1] != 0:
            raise ExpertLoadSignatureError(
                f"expert-load export: {int(values[-1])} rank(s) changed their MoE layers since "
                f"the first export ({int(values[-2])} of {world} ranks took part); keep one "
                "collector per model for the whole run, or create new reducers on every rank"
            )
        experts, n_layers = layout.experts, len(layout.layer_ids)
        n_counts = int(sum(experts))
        width = max(experts, default=0)
        counts = np.zeros((n_layers, width), dtype=np.int64)
        executed = np.zeros((n_layers, width), dtype=np.int64)
        start = 0
        for i, e in enumerate(experts):
            counts[i, :e] = values[start : start + e]
            executed[i, :e] = values[n_counts + start : n_counts + start + e]
            start += e
        tail = values[2 * n_counts : 2 * n_counts + 2 * n_layers].astype(np.int64)
        uniform = len(set(layout.topks)) <= 1
        return ExpertLoads(
            layer_ids=list(layout.layer_ids),
            counts=counts,
            routed_tokens=tail[:n_layers],
            topk=(layout.topks[0] if layout.topks else 0) if uniform else list(layout.topks),
            num_experts=list(experts),
            executed=executed,
            zero_picks=tail[n_layers:] if any(layout.zero_computation) else None,
        )


def export_expert_loads(
    collector: Any,
    group: Any = None,
    *,
    reducer: ExpertLoadReducer | None = None,
    contribute: bool | None = None,
) -> ExpertLoads:
    """End-of-step export usable on every rank, also those whose collector is None (no MoE).

    A rank with a collector may omit ``reducer`` (the collector keeps one per group). A rank
    without MoE layers must pass the same ``ExpertLoadReducer(group)`` every step: it remembers
    the layout agreed at the first export, so all ranks make the same collectives.
    """
    if reducer is not None:
        return reducer.export(collector, contribute=contribute)
    if collector is None:
        raise TypeError(
            "export_expert_loads(None, group) needs reducer=ExpertLoadReducer(group), created "
            "once at setup and passed every step, so this rank keeps the agreed layout"
        )
    return collector.export(group, contribute=contribute)


class RoutingReducer:
    """Sums the routing-consistency integers (``moe.routing``) over one process group.

    One ``all_reduce`` per export, joined by every rank of the group whether or not it holds
    MoE layers (a pipeline stage without them sends zeros); its result is read in the export's
    one host read. ``moe_layers``: every MoE layer of the model (global ids), the same list on
    every rank, so the payload layout needs no agreement round.
    """

    def __init__(
        self, moe_layers: list[int], topk: int, group: Any = None, *, rollout_experts: int = 0
    ) -> None:
        """``topk``: experts per token; ``group``: ranks to sum over (default world);
        ``rollout_experts`` > 0: also sum the rollout's own expert counts (that many columns,
        the trackers' ``rollout_experts``) into ``moe/rollout_max_over_ideal``."""
        self.moe_layers = list(moe_layers)
        self.topk = topk
        self.group = group
        self.rollout_experts = rollout_experts
        self._pos = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._rows: dict[torch.device, torch.Tensor] = {}  # a host-to-device copy syncs

    def enqueue(
        self, tracker: Any, *, per_layer: bool, contribute: bool = True
    ) -> Pending[dict[str, Any]]:
        """Launch the summing ``all_reduce``; the Pending turns the sums into ``moe/routing_*``."""
        world, _ = _world(self.group)
        device = collective_device(self.group)
        n_layers = len(self.moe_layers)
        stats = torch.zeros(n_layers, routing.LAYER_SLOTS, dtype=torch.int64, device=device)
        tokens = torch.zeros(routing.GLOBAL_SLOTS, dtype=torch.int64, device=device)
        experts = self.rollout_experts
        rollout = torch.zeros(n_layers, experts, dtype=torch.int64, device=device)
        if tracker is not None and contribute:
            local, local_tokens = tracker.local_stats()
            if device not in self._rows:
                rows = [self._pos[layer] for layer in tracker.layer_ids]
                self._rows[device] = torch.tensor(rows, dtype=torch.int64).to(device)
            rows = self._rows[device]
            stats.index_copy_(0, rows, local.to(device))
            tokens.add_(local_tokens.to(device))
            if experts and tracker.rollout_counts is not None:
                rollout.index_copy_(0, rows, tracker.rollout_counts.to(device))
        payload = torch.cat(
            [
                stats.reshape(-1),
                tokens,
                rollout.reshape(-1),
                torch.ones(1, dtype=torch.int64, device=device),
            ]
        )
        if world > 1:
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.group)

        def finish(host: list[np.ndarray]) -> dict[str, Any]:
            values = host[0]
            if values[-1] != world:
                raise RuntimeError(
                    f"routing export: {int(values[-1])} of {world} ranks took part; every rank "
                    "must call finish_step with track_routing_consistency on"
                )
            body_end = n_layers * routing.LAYER_SLOTS
            tail_end = body_end + routing.GLOBAL_SLOTS
            out = routing.routing_metrics(
                self.moe_layers,
                values[:body_end],
                values[body_end:tail_end],
                self.topk,
                per_layer=per_layer,
            )
            if experts:
                counts = values[tail_end:-1].reshape(n_layers, experts)
                out.update(
                    router_health.rollout_balance_metrics(
                        self.moe_layers, counts, per_layer=per_layer
                    )
                )
            return out

        return Pending((payload,), finish)


class RouterHealthReducer:
    """Reduces the router-health sums (``moe.router_health``) over one process group.

    Two collectives per export, joined by every rank of the group whether or not it holds MoE
    layers: one ``all_reduce(SUM)`` of the float64 per-layer sums (data, expert and pipeline
    parallel ranks hold different tokens or layers; tensor-parallel replicas send zeros) and
    one ``all_reduce(MAX)`` of the per-layer largest ``|logit|``. Their result joins the
    export's one host read. The rows are the MoE layers agreed by the expert-load export.
    """

    def __init__(self, group: Any = None) -> None:
        """``group``: ranks to reduce over (default world)."""
        self.group = group
        self._rows: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def enqueue(
        self,
        tracker: Any,
        layer_ids: list[int],
        topks: list[int],
        *,
        per_layer: bool,
        contribute: bool = True,
    ) -> Pending[dict[str, Any]]:
        """Launch both reductions; the Pending turns the sums into the ``moe/...router_*`` keys.

        ``layer_ids`` and ``topks``: the layout agreed by the expert-load export
        (``ExpertLoadReducer``), the same on every rank."""
        world, _ = _world(self.group)
        device = collective_device(self.group)
        n_layers = len(layer_ids)
        sums = torch.zeros(n_layers, router_health.SLOTS, dtype=torch.float64, device=device)
        peaks = torch.zeros(n_layers, dtype=torch.float64, device=device)
        if tracker is not None and contribute:
            local_sums, local_peaks = tracker.local_stats()
            key = (tuple(tracker.layer_ids), device)
            if key not in self._rows:  # built once: a host-to-device copy would sync
                pos = {layer: i for i, layer in enumerate(layer_ids)}
                rows = [pos[layer] for layer in tracker.layer_ids]
                self._rows[key] = torch.tensor(rows, dtype=torch.int64).to(device)
            sums.index_copy_(0, self._rows[key], local_sums.to(device))
            peaks.index_copy_(0, self._rows[key], local_peaks.to(device))
        payload = torch.cat([sums.reshape(-1), torch.ones(1, dtype=torch.float64, device=device)])
        if world > 1:
            dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.group)

        def finish(host: list[np.ndarray]) -> dict[str, Any]:
            values, maxima = host
            if values[-1] != world:
                raise RuntimeError(
                    f"router-health export: {int(values[-1])} of {world} ranks took part; every "
                    "rank must call finish_step with track_router_health on"
                )
            return router_health.router_health_metrics(
                layer_ids,
                values[:-1],
                maxima,
                topks=topks,
                per_layer=per_layer,
            )

        return Pending((payload, peaks), finish)
