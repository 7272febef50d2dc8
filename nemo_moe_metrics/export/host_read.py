"""The one device-to-host read of a metrics export: every family's results in one copy.

Each metric family splits its export in two halves. ``enqueue`` launches its device work and
collectives (in the same order on every rank) and returns a :class:`Pending`: the device
tensors to read and the host arithmetic to run on their values. :func:`read_once` copies the
tensors of every pending family to the host together (one transfer per device, one wait), then
calls each family's ``finish`` in order. A new family joins the export by returning a
``Pending`` from its own ``enqueue`` and being appended to the list the worker reads.

Values are exact: integer tensors travel as int64 and floating tensors as float64 bit patterns
inside one int64 buffer, so a count or a float32 loss arrives exactly as it left the device.

:func:`collective_device` is the one rule for which device a family's collective runs on
(the tensors an ``enqueue`` reduces before this read): CPU for gloo, CUDA for NCCL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass
class Pending(Generic[T]):
    """One family's queued export: ``tensors`` to read, ``finish(host_values) -> result``.

    ``finish`` receives one numpy array per tensor, same shape, int64 for integer tensors and
    float64 for floating ones. ``fence`` (optional) is a wait the family needs anyway (the step
    timer's event, recorded on the current stream after the copies); it returns whether it
    waited, and when it did it replaces the plain stream wait that covers the copies.
    """

    tensors: tuple[torch.Tensor, ...]
    finish: Callable[[list[np.ndarray]], T]
    fence: Callable[[], bool] | None = None

    def then(self, fn: Callable[[T], Any]) -> Pending[Any]:
        """The same read, with ``fn`` applied to the finished result (host arithmetic)."""
        finish = self.finish
        return Pending(self.tensors, lambda host: fn(finish(host)), self.fence)


def collective_device(group: Any = None, preferred: torch.device | None = None) -> torch.device:
    """The device a collective over ``group`` (None: the world) takes its tensors on.

    CPU without an initialised process group and for gloo (which reduces CPU tensors); else
    ``preferred`` when it is a CUDA device (where the values already are), else the current
    CUDA device for a backend with NCCL (which reduces CUDA tensors only), else CPU.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        return torch.device("cpu")
    if preferred is not None and preferred.type == "cuda":
        return preferred
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_values(
    values: float | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host numbers as a ``dtype`` tensor on ``device`` without a blocking copy (pinned, then
    ``non_blocking``): the way back to the device, which no export may wait on."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def done(result: T) -> Pending[T]:
    """A family with nothing to read this step (e.g. no tracked loss): its result as is."""
    return Pending((), lambda _: result)


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.dtype.is_floating_point:
        return flat.to(torch.float64).view(torch.int64)  # the bits, not a conversion
    if flat.dtype.is_complex:
        raise TypeError("read_once: complex tensors are not supported")
    return flat.to(torch.int64)


def read_once(pendings: Sequence[Pending[Any]]) -> list[Any]:
    """Read every pending tensor to the host with one wait, then finish each family in order.

    The only host-device synchronisation of an export: device tensors are packed per device and
    copied with ``non_blocking=True``; one wait (the families' fences, else the device's current
    stream) covers the copies; one read of the packed host buffer follows.
    """
    tensors = [t for p in pendings for t in p.tensors]
    host = _copy_to_host(tensors, [p.fence for p in pendings if p.fence is not None])
    out = []
    start = 0
    for p in pendings:
        n = len(p.tensors)
        out.append(p.finish(host[start : start + n]))
        start += n
    return out


def _copy_to_host(
    tensors: list[torch.Tensor], fences: list[Callable[[], bool]]
) -> list[np.ndarray]:
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    accelerators = []
    for device, idx in by_device.items():
        packed = torch.cat([_as_int64(tensors[i]) for i in idx])
        if device.type != "cpu":
            packed = packed.to("cpu", non_blocking=True)  # lands in pinned memory
            accelerators.append(device)
        parts.append(packed)
        order += idx
    waited = [fence() for fence in fences]
    if accelerators and not any(waited):
        for device in accelerators:
            torch.get_device_module(device.type).current_stream(device).synchronize()
    if not parts:
        return []
    buffer = (torch.cat(parts) if len(parts) > 1 else parts[0]).numpy()  # the one read
    values: list[np.ndarray] = [np.empty(0)] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        n = t.numel()
        raw = buffer[offset : offset + n]
        offset += n
        arr = raw.view(np.float64) if t.dtype.is_floating_point else raw
        values[i] = arr.reshape(tuple(t.shape)).copy()
    return values
