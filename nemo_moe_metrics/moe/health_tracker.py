"""The device accumulators of router decision health: one rank, one step.

The router hooks (``moe.collector``) call :meth:`RouterHealthTracker.observe` with a router
forward's own logits; the tracker keeps them and judges every kept forward of a scoring in one
pass (``router_health.decision_table`` over their tokens concatenated) at the step's end or
when the host staging it shares holds ``deferred.FLUSH_BYTES``; the reduction (``moe.reduction``)
sums :meth:`RouterHealthTracker.local_stats` over ranks inside the export's one host read. Nothing
here reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_moe_metrics.moe.deferred import FLUSH_BYTES, ConstantTensors, HostStaging
from nemo_moe_metrics.moe.router_health import (
    MICRO_RATIO,
    SLOTS,
    RouterScoring,
    decision_table,
    forwards_balance,
    slot_scale,
)


class _KeptForwards:
    """Router forwards of one scoring, kept until the tracker judges them together."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        self.valid: list[torch.Tensor] = []
        self.chosen: list[torch.Tensor] = []


class RouterHealthTracker:
    """Device accumulators of one rank's router decision health for one step.

    ``scorings``: per hooked layer (global id), how its router decides, or None when its score
    function is unknown (then only ``max_over_ideal_microbatch`` is measured for it).

    A forward's logits (and a copy of its expert bias, which the trainer may move before the
    step ends) are kept, not judged at once: :meth:`local_stats`, or a staging holding
    :data:`FLUSH_BYTES`, judges every kept forward of one scoring in one pass, so a
    step costs a few dozen device ops whatever its layers and microbatches. Each forward's
    routed counts are kept too (a reference to the collector's fresh tensor, no copy) until
    :meth:`local_stats` turns them into the microbatch balance in one pass.
    """

    def __init__(
        self,
        scorings: dict[int, RouterScoring | None],
        *,
        near_tie_gap: float,
        device: torch.device,
        before_stats: Callable[[], None] | None = None,
        staging: HostStaging | None = None,
    ) -> None:
        """See the class docstring; ``near_tie_gap``: the relative gap below which a decision
        counts as a near tie (``router_near_tie_gap``); ``before_stats``: called first by
        :meth:`local_stats` (the collector hands its kept forwards' counts over there);
        ``staging``: the host memory forwards are kept in (the collector's, shared with its
        other trackers; None: one of its own)."""
        self.layer_ids = sorted(scorings)
        self.near_tie_gap = float(near_tie_gap)
        self._scoring = dict(scorings)
        self._row = {layer: i for i, layer in enumerate(self.layer_ids)}
        scale = [
            slot_scale(s) if s is not None else [1.0] * SLOTS
            for s in (self._scoring[layer] for layer in self.layer_ids)
        ]
        self._scale = torch.tensor(scale, dtype=torch.float64).reshape(-1, SLOTS)
        self._forwards: list[list[torch.Tensor]] = [[] for _ in self.layer_ids]
        self._forward_blocks: list[tuple[list[int], torch.Tensor]] = []
        self._before_stats = before_stats
        self._kept: dict[tuple, _KeptForwards] = {}
        self._own_staging = staging is None  # a shared one is reset by its owner
        self._staging = staging if staging is not None else HostStaging()
        self._staging.add_consumer(self._judge_kept)
        self._biases: dict[int, tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = {}
        self._allocate(device)

    def _allocate(self, device: torch.device) -> None:
        self._device = torch.device(device)
        self.sums = torch.zeros(len(self.layer_ids), SLOTS, dtype=torch.float64, device=device)
        self.max_abs = torch.zeros(len(self.layer_ids), dtype=torch.float64, device=device)
        self._scale = self._scale.to(device)
        self._constants = ConstantTensors()

    def scoring(self, layer_id: int) -> RouterScoring | None:
        """How the router of global layer ``layer_id`` decides; None when it is not judged."""
        return self._scoring[layer_id]

    # -- per router forward (hot path: no arithmetic, kept for the batched pass) ------------
    def observe(
        self,
        layer_id: int,
        counts: torch.Tensor | None,
        logits: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ) -> None:
        """One counted router forward: its routed counts ``[E]`` (None: handed over later by
        :meth:`observe_forwards`) and, where known, its logits (and its own top-k,
        ``HealthSource.chosen``: a ``[T, E]`` bool map or ``[T, k]`` int64 expert ids)."""
        if self._staging.nbytes >= FLUSH_BYTES:  # judge what is kept before keeping more
            self._staging.flush()
        row = self._row[layer_id]
        if counts is not None:
            if counts.device != self._device:  # the model moved after attach
                self._move(counts.device)
            self._forwards[row].append(counts)
        scoring = self._scoring[layer_id]
        if scoring is None or logits is None:
            return
        if logits.shape[-1] != scoring.num_experts:  # a shape: no sync
            raise ValueError(
                f"router health, MoE layer {layer_id}: the router's logits have "
                f"{logits.shape[-1]} columns but its scoring ranks {scoring.num_experts} classes; "
                "its routing is described wrongly (adapters/hf_health.py): turn "
                "track_router_health off for this model and report the model"
            )
        z = logits if logits.dim() == 2 else logits.reshape(-1, scoring.num_experts)
        if chosen is not None and chosen.shape[0] != z.shape[0]:  # not this forward's rows
            chosen = None
        choice = None if chosen is None else chosen.dtype  # a map or expert ids
        key = (scoring, z.dtype, z.device, bias is not None, valid is not None, choice)
        batch = self._kept.get(key)
        if batch is None:
            batch = self._kept[key] = _KeptForwards()
        keep = self._staging.keep
        batch.rows.append(row)
        batch.logits.append(keep(z))
        if bias is not None:
            batch.biases.append(self._bias_copy(row, bias))
        if valid is not None:
            batch.valid.append(keep(valid))
        if chosen is not None:
            batch.chosen.append(keep(chosen))

    def observe_forwards(self, layer_ids: list[int], counts: torch.Tensor) -> None:
        """Routed counts ``[F, E]`` of ``F`` counted forwards, of layers ``layer_ids``."""
        self._forward_blocks.append(([self._row[layer] for layer in layer_ids], counts))

    def _bias_copy(self, row: int, bias: torch.Tensor) -> torch.Tensor:
        """A copy of the expert bias as this forward saw it (megatron moves the bias after the
        step's last backward, before the flush), one per layer while the bias is unchanged:
        its version counter, a host int, says when it was written."""
        # Keyed by address and version: a view read anew each forward is the same bias; the
        # tensor is held, so no other tensor can take its address meanwhile.
        stamp = (bias.data_ptr(), bias._version)
        kept = self._biases.get(row)
        if kept is not None and kept[1] == stamp:
            return kept[2]
        copy = bias.detach().clone()
        self._biases[row] = (bias, stamp, copy)
        return copy

    def flush(self) -> None:
        """Judge every kept forward (device ops only): one pass per scoring, over the tokens of
        all its forwards concatenated, summed into each forward's layer; the staging's other
        consumers pass over theirs too."""
        self._staging.flush()

    def _judge_kept(self) -> None:
        kept, self._kept = self._kept, {}
        for (scoring, _, device, _, padded, _), batch in kept.items():
            z = torch.cat(batch.logits) if len(batch.logits) > 1 else batch.logits[0]
            z = z if z.dtype == torch.float32 else z.float()
            lengths = [t.shape[0] for t in batch.logits]
            forward_of = self._constants.segments(lengths, device)
            row_of = self._constants.index(batch.rows, device).index_select(0, forward_of)
            bias = None
            if batch.biases:
                biases = torch.stack(batch.biases).reshape(len(lengths), -1)
                bias = biases.to(device, torch.float32).index_select(0, forward_of)
            if padded:
                weight = torch.cat(batch.valid).to(device=device, dtype=torch.float32)
            else:
                weight = self._constants.ones((z.shape[0],), torch.float32, device)
            chosen = None
            if batch.chosen:
                chosen = torch.cat(batch.chosen) if len(batch.chosen) > 1 else batch.chosen[0]
            table, slots, magnitude = decision_table(
                z, scoring, self.near_tie_gap, bias, weight, padded, chosen=chosen
            )
            if device != self._device:  # logits on another device than the counts
                table, magnitude, row_of = (t.to(self._device) for t in (table, magnitude, row_of))
            per_row = torch.zeros(
                len(self.layer_ids), len(slots), dtype=torch.float64, device=self._device
            )
            per_row.index_add_(0, row_of, table.to(torch.float64))
            self.sums.index_add_(1, self._constants.index(slots, self._device), per_row)
            self.max_abs.scatter_reduce_(0, row_of, magnitude.to(torch.float64), "amax")

    def _move(self, device: torch.device) -> None:
        self.flush()
        sums, max_abs = self.sums.to(device), self.max_abs.to(device)
        self._allocate(device)
        self.sums.copy_(sums)
        self.max_abs.copy_(max_abs)

    # -- step boundary ---------------------------------------------------------------------
    def _fold_forwards(self) -> None:
        """Add the kept forwards' microbatch balance to the sums: one pass per block of
        forwards (those counted one at a time stacked into one when their layers saw the same
        number of forwards with the same experts, the usual step)."""
        kept, blocks = self._forwards, self._forward_blocks
        self._forwards, self._forward_blocks = [[] for _ in self.layer_ids], []
        if any(kept):
            shapes = {(len(f), f[0].shape, f[0].device) if f else None for f in kept}
            if len(shapes) == 1:
                rows = [row for row, f in enumerate(kept) for _ in f]
                blocks.append((rows, torch.stack([c for f in kept for c in f])))
            else:
                blocks += [([row] * len(f), torch.stack(f)) for row, f in enumerate(kept) if f]
        for rows, counts in blocks:
            device = self.sums.device
            balance = forwards_balance(counts.to(device))
            self.sums[:, MICRO_RATIO:].index_add_(0, self._constants.index(rows, device), balance)

    def local_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([local layers, SLOTS] sums, [local layers] max |z|)`` float64 device tensors."""
        if self._before_stats is not None:
            self._before_stats()
        self.flush()
        self._fold_forwards()
        return self.sums * self._scale, self.max_abs

    def reset(self) -> None:
        """Zero the step's accumulators (start of a new step)."""
        self.sums.zero_()
        self.max_abs.zero_()
        self._forwards = [[] for _ in self.layer_ids]
        self._forward_blocks = []
        self._kept = {}
        if self._own_staging:
            self._staging.reset()
