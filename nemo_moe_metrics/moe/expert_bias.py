"""Aux-loss-free balancing metrics: how far each MoE layer's expert bias spreads and moves.

Routers balanced without an aux loss (DeepSeek-V3 style; megatron-core
``moe_router_enable_expert_bias`` keeps ``router.expert_bias``, torchtitan keeps
``MoE.expert_bias_E``) add a per-expert bias to the routing scores and nudge it after every
optimizer step towards the under-loaded experts. Their users see no aux loss; what they watch is
the bias itself. Per MoE layer ``i`` (global id):

- ``moe/layer_{i}/expert_bias_range``: ``max(bias) - min(bias)``, in score units;
- ``moe/layer_{i}/expert_bias_update``: mean over experts of ``|bias - bias at the last
  export|`` (the first export compares with the bias at attach time);

and their means over the MoE layers that have a bias (``moe/expert_bias_range``,
``moe/expert_bias_update``).

No host read of its own: :meth:`ExpertBiasTracker.enqueue` computes on the device, launches one
``all_reduce(MAX)`` (data-parallel replicas hold the same bias; pipeline stages fill their own
layers, the others contribute 0 and both values are >= 0) and hands the result to the export's
one read (``host_read.read_once``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending, collective_device

BiasGetter = Callable[[], "torch.Tensor | None"]
_FIELDS = 3  # per global layer: [present, range, update]


def _local(t: torch.Tensor) -> torch.Tensor:
    # A replicated DTensor buffer (torchtitan under tensor/expert parallel): its local copy.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ExpertBiasTracker:
    """Reads the expert-bias buffers of one rank's MoE layers at each export."""

    def __init__(self, sources: Sequence[tuple[int, BiasGetter]], group: Any = None) -> None:
        """``sources``: ``(global layer id, getter of the layer's current bias buffer)``.

        Getters are called at every export, so a buffer replaced after attach (``model.to``,
        torchtitan's ``init_weights``) is still the one read.
        """
        self.group = group
        self._sources = sorted(sources, key=lambda s: s[0])
        # The bias at the last export, as one [layers, experts] float64 tensor when every layer
        # has the same experts on one device (one batched computation), else per layer.
        self._previous: tuple[tuple[int, ...], Any] | None = None
        self._index: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._current()  # the reference for the first export's update

    @property
    def layer_ids(self) -> list[int]:
        """Global ids of this rank's layers whose router has a bias (may be empty)."""
        return [layer for layer, get in self._sources if get() is not None]

    def _current(self) -> tuple[tuple[int, ...], torch.Tensor | None]:
        """``(layers, [layers, 3] float64 values [1, range, update])`` on the buffers' device."""
        found = [(layer, get()) for layer, get in self._sources]
        layers = tuple(layer for layer, b in found if b is not None)
        tensors = [_local(b).detach() for _, b in found if b is not None]
        if not tensors:
            return layers, None
        if len({(t.shape, t.device) for t in tensors}) == 1:
            now: Any = torch.stack(tensors).to(torch.float64)  # a copy: safe to keep
            prev = self._previous[1] if self._previous and self._previous[0] == layers else None
            if (
                not isinstance(prev, torch.Tensor)
                or prev.shape != now.shape
                or prev.device != now.device
            ):
                prev = now  # first sight of these buffers (or they moved): no change yet
            update = (now - prev).abs().mean(dim=1)
            spread = now.amax(dim=1) - now.amin(dim=1)
        else:  # layers with different expert counts or devices: one layer at a time
            now = {
                layer: t.to(torch.float64).clone() for layer, t in zip(layers, tensors, strict=True)
            }
            before = self._previous[1] if self._previous else {}
            before = before if isinstance(before, dict) else {}
            rows = []
            for layer, t in now.items():
                p = before.get(layer)
                p = t if p is None or p.shape != t.shape or p.device != t.device else p
                rows.append(torch.stack([t.max() - t.min(), (t - p).abs().mean()]))
            device = tensors[0].device
            both = torch.stack([r.to(device) for r in rows])
            spread, update = both[:, 0], both[:, 1]
        self._previous = (layers, now)
        ones = torch.ones_like(spread)
        return layers, torch.stack([ones, spread, update], dim=1)

    def enqueue(self, layer_ids: Sequence[int]) -> Pending[dict[str, float]]:
        """Device values for the global MoE ``layer_ids`` (every rank, same list), one MAX reduce.

        Collective when a process group is initialised: every rank of ``group`` calls it at the
        same point, also ranks without biased layers.
        """
        layer_ids = list(layer_ids)
        device = collective_device(self.group)
        payload = torch.zeros(len(layer_ids), _FIELDS, dtype=torch.float64, device=device)
        layers, values = self._current()
        if values is not None:
            key = (layers, device)
            if key not in self._index:  # built once: a host-to-device copy would sync
                pos = {layer: i for i, layer in enumerate(layer_ids)}
                missing = [layer for layer in layers if layer not in pos]
                if missing:
                    raise ValueError(f"expert bias of layers {missing} is not on a MoE layer")
                index = torch.tensor([pos[layer] for layer in layers], dtype=torch.int64)
                self._index[key] = index.to(device)
            payload.index_copy_(0, self._index[key], values.to(device))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=self.group)
        return Pending((payload,), lambda host: bias_metrics(layer_ids, host[0]))


def bias_metrics(layer_ids: Sequence[int], values: np.ndarray) -> dict[str, float]:
    """The keys from reduced ``[layers, (present, range, update)]`` host values (pure)."""
    out: dict[str, float] = {}
    present = [i for i in range(len(layer_ids)) if values[i, 0] > 0]
    if not present:
        return out
    for i in present:
        out[mn.expert_bias_layer_key(layer_ids[i], "expert_bias_range")] = float(values[i, 1])
        out[mn.expert_bias_layer_key(layer_ids[i], "expert_bias_update")] = float(values[i, 2])
    out[mn.EXPERT_BIAS_RANGE] = float(np.mean(values[present, 1]))
    out[mn.EXPERT_BIAS_UPDATE] = float(np.mean(values[present, 2]))
    return out


def split_layer_keys(metrics: dict[str, float], per_layer: bool) -> dict[str, float]:
    """Drop the per-layer bias keys unless ``moe_per_layer_logging`` is on."""
    if per_layer:
        return metrics
    return {k: v for k, v in metrics.items() if k in (mn.EXPERT_BIAS_RANGE, mn.EXPERT_BIAS_UPDATE)}
