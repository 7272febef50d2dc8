"""Where a rank's expert counts accumulate: per-layer device buffers, and kept picks.

:class:`LayerBuffers` holds every layer's routed counts, executed counts, tokens and
zero-computation picks of one device in one int64 buffer laid out as the reduction's payload
(``moe.reduction``), so a step's reset and export are one device op each.

:class:`KeptPicks`: a router whose spec gives its picks (``RouterSpec.picks_fn``: the
``[T, k]`` expert ids of every Hugging Face experts call, megatron-core's ``[T, E]`` routing
map) is not counted in its forward. Counting one forward (routed counts of the real rows,
executed counts of every row, the real tokens, the accumulations) takes a few to a dozen
small device ops, which on a CPU cost more than their arithmetic. The collector keeps each
forward's picks and real-token mask (copies in the host staging it shares with the other
trackers, ``deferred.HostStaging``) and :func:`forward_counts` counts every kept forward of
one kind at once, a few ops per batch, at the step's end or when the staging holds
``deferred.FLUSH_BYTES``. Pure tensor arithmetic; nothing is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nemo_moe_metrics.export.host_read import host_values
from nemo_moe_metrics.moe.deferred import ConstantTensors, HostStaging
from nemo_moe_metrics.moe.router_spec import per_expert


class LayerAccumulator:
    """Routed counts [E], executed counts [E], routed tokens [] and picks of zero-computation
    experts [] of one MoE layer: int64 views into its device's shared buffer (see
    :meth:`ExpertLoadCollector.local_payload`), so a step's reset and export are one device op
    each whatever the layers.

    Each kept with as few device ops per forward as the forward needs: a token count given as
    a host int is summed on the host until :meth:`tokens_now`; executed counts are kept apart
    only once some forward executed other experts than it counted (padding), until then they
    are the routed counts themselves.
    """

    def __init__(
        self,
        layer_id: int,
        num_experts: int,
        topk: int,
        device: torch.device,
        zero_computation: bool = False,
    ):
        self.layer_id = layer_id
        self.num_experts = num_experts
        self.topk = topk
        self.zero_computation = zero_computation
        self.device = device
        self.executed_apart = False  # False: the executed counts equal the routed counts
        self.counted = False  # some counts were added since the last reset
        self.host_tokens = 0
        # Views, bound by the collector (LayerBuffers), and where they sit in its buffer
        self.counts = self.executed = self.tokens = self.zero_picks = self.rollout = None
        self.start = self.slot = 0

    def add(
        self,
        counts: torch.Tensor,
        tokens: torch.Tensor | int,
        executed: torch.Tensor | None = None,
        zero_picks: torch.Tensor | None = None,
    ) -> None:
        """One forward's routed counts [E] (or a [T, E] map), tokens, executed counts (None or
        the counts tensor itself: the same) and zero-computation picks."""
        same = executed is None or executed is counts
        counts = per_expert(counts)
        if not same:
            self.keep_executed_apart()
        self.counted = True
        self.counts.add_(counts)
        if self.executed_apart:
            self.executed.add_(counts if same else per_expert(executed))
        if isinstance(tokens, int):
            self.host_tokens += tokens
        else:
            self.tokens.add_(tokens)
        if zero_picks is not None:
            self.zero_picks.add_(zero_picks)

    def keep_executed_apart(self) -> None:
        """From now on this step, add executed counts apart from the routed ones."""
        if not self.executed_apart:
            if self.counted:  # every forward so far executed what it counted
                self.executed.copy_(self.counts)
            self.executed_apart = True

    def tokens_now(self) -> torch.Tensor:
        """The routed tokens [] so far (the host-counted ones added in: one op a step)."""
        if self.host_tokens:
            self.tokens.add_(self.host_tokens)
            self.host_tokens = 0
        return self.tokens


class LayerBuffers:
    """The accumulators of the layers on one device, as two int64 buffers: ``state``, the
    export's layout (every layer's routed counts, then executed counts, tokens and
    zero-computation picks, in layer order), and the rollout's counts."""

    def __init__(
        self, accs: list[LayerAccumulator], device: torch.device, constants: ConstantTensors
    ) -> None:
        """``constants``: the collector's cache of index tensors (shared with its pass)."""
        self.accs = accs
        self.experts = sum(a.num_experts for a in accs)
        n, layers = self.experts, len(accs)
        self.state = torch.zeros(2 * n + 2 * layers, dtype=torch.int64, device=device)
        self.rollout = torch.zeros(n, dtype=torch.int64, device=device)
        start = 0
        for i, acc in enumerate(accs):
            end = start + acc.num_experts
            acc.device = torch.device(device)
            acc.counts, acc.executed = self.state[start:end], self.state[n + start : n + end]
            acc.tokens, acc.zero_picks = self.state[2 * n + i], self.state[2 * n + layers + i]
            acc.rollout = self.rollout[start:end]
            acc.start, acc.slot = start, i
            start = end
        self._constants = constants

    def add_forwards(
        self,
        accs: list[LayerAccumulator],
        routed: torch.Tensor,
        executed: torch.Tensor | None,
        tokens: torch.Tensor | None,
    ) -> None:
        """Counts of forwards, one per entry of ``accs`` (their layers, on this device):
        ``routed`` ``[F, E]``, ``executed`` ``[F, E]`` (None: the routed ones) and ``tokens``
        ``[F]`` (None: counted on the host already)."""
        n, device, width = self.experts, self.state.device, routed.shape[1]
        starts = [acc.start for acc in accs]
        if executed is not None:
            for acc in accs:
                acc.keep_executed_apart()
        for acc in accs:
            acc.counted = True
        self.state.index_add_(0, self._constants.blocks(starts, width, device), routed.reshape(-1))
        if executed is not None or any(acc.executed_apart for acc in accs):
            dest = self._constants.blocks([n + s for s in starts], width, device)
            self.state.index_add_(0, dest, (routed if executed is None else executed).reshape(-1))
        if tokens is not None:
            slots = self._constants.index([2 * n + acc.slot for acc in accs], device)
            self.state.index_add_(0, slots, tokens)

    def payload(self) -> torch.Tensor:
        """``state`` with every layer's tokens and executed counts brought up to date."""
        n = self.experts
        hosts = [acc.host_tokens for acc in self.accs]
        if any(hosts):
            self.state[2 * n : 2 * n + len(hosts)].add_(
                host_values(hosts, torch.int64, self.state.device)
            )
            for acc in self.accs:
                acc.host_tokens = 0
        apart = [acc.executed_apart for acc in self.accs]
        if not any(apart):  # every layer executed what it counted
            self.state[n : 2 * n].copy_(self.state[:n])
        else:
            for acc in self.accs:
                if not acc.executed_apart:
                    acc.executed.copy_(acc.counts)
        return self.state

    def reset(self) -> None:
        """Zero the step's accumulators (the rollout's are kept)."""
        self.state.zero_()
        for acc in self.accs:
            acc.executed_apart = acc.counted = False
            acc.host_tokens = 0


@dataclass
class PickBatch:
    """Kept forwards that count together: one device, one ``num_experts``, all with a
    real-token mask or none, and picks of one kind: ``[T, k]`` expert ids of one ``k``, or
    ``[T, E]`` bool maps of one ``T`` (``maps``)."""

    num_experts: int
    maps: bool
    owners: list[LayerAccumulator] = field(default_factory=list)
    picks: list[torch.Tensor] = field(default_factory=list)
    valid: list[torch.Tensor] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)  #: the forwards' numbers (collector's)


class KeptPicks:
    """The picks of counted forwards, kept until :meth:`take` (see the module docstring)."""

    def __init__(self, staging: HostStaging | None = None) -> None:
        """``staging``: the host memory the picks are copied into (shared with the other
        trackers of a collector, whose flush counts them); None: one of its own."""
        self._batches: dict[tuple, PickBatch] = {}
        self._staging = staging if staging is not None else HostStaging()

    def keep(
        self,
        owner: LayerAccumulator,
        picks: torch.Tensor,
        valid: torch.Tensor | None,
        serial: int | None = None,
    ) -> None:
        """One forward's picks of ``owner``'s layer, ``[T, k]`` expert ids or a ``[T, E]``
        bool map; ``valid`` ``[T]`` bool (False = padding) or None (every row real, its
        tokens counted on the host now); ``serial``: the forward's number, by which the
        collector's subscribers know it when the batch is counted (``moe.subscriptions``)."""
        maps = picks.dtype == torch.bool
        # Maps stack (one T), ids concatenate (one k)
        key = (owner.num_experts, maps, picks.shape[0 if maps else 1], picks.device)
        key += (valid is not None,)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = PickBatch(owner.num_experts, maps)
        batch.owners.append(owner)
        batch.picks.append(self._staging.keep(picks))
        if serial is not None:
            batch.serials.append(serial)
        if valid is None:
            owner.host_tokens += picks.shape[0]
        else:
            batch.valid.append(self._staging.keep(valid))

    def take(self) -> list[PickBatch]:
        """The kept forwards, forgotten here; their copies stay valid until the staging's
        next reset."""
        batches, self._batches = list(self._batches.values()), {}
        return batches


def forward_counts(
    batch: PickBatch, constants: ConstantTensors
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(routed [F, E], executed [F, E] or None, tokens [F] or None)`` int64 of a batch's
    ``F`` forwards: routed counts of the real rows, executed counts of every row, real tokens
    (both None without masks: every row real, executed = routed, tokens on the host)."""
    if batch.maps:
        maps = torch.stack(batch.picks)  # [F, T, E]
        every = maps.sum(dim=1)
        if not batch.valid:
            return every, None, None
        valid = torch.stack(batch.valid)  # [F, T]
        return (maps & valid.unsqueeze(-1)).sum(dim=1), every, valid.sum(dim=1)
    ids = torch.cat(batch.picks) if len(batch.picks) > 1 else batch.picks[0]
    device, width = ids.device, batch.num_experts
    lengths = [t.shape[0] for t in batch.picks]
    forwards = len(lengths)
    # Each pick's place in the [F, E] counts: its forward's row, then its expert.
    place = (ids + constants.segment_starts(lengths, width, device).unsqueeze(1)).reshape(-1)
    every = torch.zeros(forwards * width, dtype=torch.int64, device=device)
    every.index_add_(0, place, constants.ones(place.shape, torch.int64, device))
    if not batch.valid:
        return every.reshape(forwards, width), None, None
    valid = torch.cat(batch.valid) if len(batch.valid) > 1 else batch.valid[0]
    real = valid.to(torch.int64)
    routed = torch.zeros(forwards * width, dtype=torch.int64, device=device)
    routed.index_add_(0, place, real.unsqueeze(1).expand(ids.shape).reshape(-1))
    tokens = torch.zeros(forwards, dtype=torch.int64, device=device)
    tokens.index_add_(0, constants.segments(lengths, device), real)
    return routed.reshape(forwards, width), every.reshape(forwards, width), tokens
