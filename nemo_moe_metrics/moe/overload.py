"""megatron-core's overload factor, from our own counts: ``moe/{avg,max,max_cum}_overload_factor``.

megatron-core's dev branch (``MoEOverloadFactorTracker``, PR #4110, with
``log_moe_overload_factor``) logs, for expert parallelism, how far the busiest TP x EP rank is over
its balanced share. Its definitions, computed here from the same quantities (each training forward's
executed routing map, as the dispatcher receives it):

- an *entry* is one training forward of one MoE layer (a microbatch); ``tokens(r)``: the
  assignments EP rank ``r``'s experts receive in it from every rank of the EP group (rank ``r``
  holds experts ``[r*E/EP, (r+1)*E/EP)``; padding included, after capacity dropping: what the
  experts execute); ``balanced``: the group's ``rows x top-k`` (tokens routed, before dropping)
  summed over its ranks, over ``EP``;
- ``overload(entry) = max_r tokens(r) / balanced``, on each expert-data-parallel replica;
- ``moe/avg_overload_factor``: the mean over entries (every layer's microbatches) and replicas;
  ``moe/max_overload_factor``: the max; per layer (``moe_per_layer_logging``)
  ``moe/avg_overload_factor_layer_{i}`` and ``moe/max_overload_factor_layer_{i}``;
- ``moe/max_cum_overload_factor``: on each rank, the running sum of the tokens its experts
  received, ``+`` at each layer's forward and ``-`` at its backward, in the order they ran (the
  tokens held for backward), its peak over the peak of the same running sum of the rank's own
  ``rows x top-k``; the max over ranks.

With tensor parallel 1 the TP x EP group is the EP group. One difference: megatron logs the
mean of a pipeline stage's own layers on that stage; the mean here is over every stage's layers
(the max and the cumulative form are the max over stages in both). A step whose forwards did not
all reach their backward (a recomputation that replays them under ``no_grad``, a forward whose
output gets no gradient) has no cumulative key. Device ops only until the export's one read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending, collective_device


class OverloadTracker:
    """Per training forward of a MoE layer: its executed tokens per EP rank and balanced count,
    and the order of the forwards and their backwards (host bookkeeping, device values)."""

    def __init__(self, ep_size: int) -> None:
        self.ep_size = ep_size
        self.layers: list[int] = []  # each forward's layer id
        self.balanced: list[Any] = []  # each forward's rows x top-k (int, or a 0-d tensor)
        self.events: list[int] = []  # forward i: i + 1; its backward: -(i + 1)
        self._loads: list[tuple[list[int], torch.Tensor]] = []  # (forwards, [F, EP] tokens)

    def forward(self, layer_id: int, output: Any) -> int:
        """A counted training forward of ``layer_id`` begins; its backward is recorded when
        the gradient of its output arrives. Returns the forward's index."""
        index = len(self.layers)
        self.layers.append(layer_id)
        self.balanced.append(0)
        self.events.append(index + 1)
        out = output[0] if isinstance(output, tuple | list) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=index: self.events.append(-(i + 1)))
        return index

    def add(self, forwards: list[int], executed: torch.Tensor, balanced: list[Any]) -> None:
        """``executed [F, E]``: the forwards' executed counts; ``balanced``: each one's rows x
        top-k. Layers whose experts do not split over the EP ranks are left out."""
        if executed.shape[-1] % self.ep_size:
            return
        per_rank = executed.reshape(len(forwards), self.ep_size, -1).sum(-1)
        self._loads.append((list(forwards), per_rank))
        for index, value in zip(forwards, balanced, strict=True):
            self.balanced[index] = value

    def reset(self) -> None:
        """Forget the step (exported, or discarded)."""
        self.layers, self.balanced, self.events, self._loads = [], [], [], []

    def enqueue(
        self, num_layers: int, ep_group: Any, ep_rank: int, device: torch.device
    ) -> Pending[dict[str, float]]:
        """Reduce the step (collective: every rank, in order): the EP group's sum per forward,
        then sums and maxima over the world; read with the export's one host read."""
        n, ep = len(self.layers), self.ep_size
        loads = torch.zeros(n, ep, dtype=torch.float64, device=device)
        for forwards, per_rank in self._loads:
            index = torch.tensor(forwards, dtype=torch.int64).to(device)
            loads.index_copy_(0, index, per_rank.to(device, torch.float64))
        if all(isinstance(b, int) for b in self.balanced):  # kept picks: known on the host
            own = torch.tensor(self.balanced, dtype=torch.float64).to(device)
        else:
            own = torch.stack([torch.as_tensor(b).to(device, torch.float64) for b in self.balanced])
        group_balanced = own.clone()
        if ep_group is not None and n:
            dist.all_reduce(loads, group=ep_group)
            dist.all_reduce(group_balanced, group=ep_group)
        overload = loads.max(dim=1).values / (group_balanced / ep).clamp(min=1e-12) if n else own
        layer = torch.tensor(self.layers, dtype=torch.int64).to(device)
        # [0:L] sums, [L:2L] entries, [2L:3L] maxima, [3L] the cumulative ratio
        sums = torch.zeros(2 * num_layers, dtype=torch.float64, device=device)
        sums[:num_layers].index_add_(0, layer, overload)
        sums[num_layers:].index_add_(0, layer, torch.ones_like(overload))
        peaks = torch.zeros(num_layers + 1, dtype=torch.float64, device=device)
        peaks[:num_layers].scatter_reduce_(0, layer, overload, "amax")
        peaks[num_layers] = self._cumulative(loads[:, ep_rank] if n else own, own)
        if dist.is_available() and dist.is_initialized():
            sums = sums.to(collective_device(None, sums.device))
            peaks = peaks.to(sums.device)
            dist.all_reduce(sums)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        self.reset()

        def finish(host: list[np.ndarray]) -> dict[str, float]:
            return overload_metrics(host[0][:num_layers], host[0][num_layers:], host[1])

        return Pending((sums, peaks), finish)

    def _cumulative(self, received: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Peak of the received tokens held over the peak of the own rows x top-k held; 0 when
        some forward never reached its backward (then the held tokens are not known)."""
        events = self.events
        if not events or len(events) != 2 * len(self.layers):
            return torch.zeros((), dtype=torch.float64, device=own.device)
        index = torch.tensor([abs(e) - 1 for e in events], dtype=torch.int64).to(own.device)
        sign = torch.tensor([1.0 if e > 0 else -1.0 for e in events], dtype=torch.float64)
        sign = sign.to(own.device)
        held = (received[index] * sign).cumsum(0).max()
        balanced = (own[index] * sign).cumsum(0).max()
        return held / balanced.clamp(min=1e-12)


def overload_metrics(sums: np.ndarray, entries: np.ndarray, peaks: np.ndarray) -> dict[str, float]:
    """The keys from the reduced per-layer sums, entry counts and maxima (pure arithmetic);
    per-layer keys for every layer with an entry (the family drops them unless asked)."""
    layers = [i for i in range(len(sums)) if entries[i] > 0]
    if not layers:
        return {}
    out = {
        mn.AVG_OVERLOAD_FACTOR: float(sums[layers].sum() / entries[layers].sum()),
        mn.MAX_OVERLOAD_FACTOR: float(peaks[layers].max()),
    }
    if peaks[-1] > 0:
        out[mn.MAX_CUM_OVERLOAD_FACTOR] = float(peaks[-1])
    for i in layers:
        out[mn.overload_layer_key("avg", i)] = float(sums[i] / entries[i])
        out[mn.overload_layer_key("max", i)] = float(peaks[i])
    return out


__all__ = ["OverloadTracker", "overload_metrics"]
