"""Count host reads of tensor data: the events that make the host wait for the device on a GPU.

On a CPU-only machine nothing waits, but the same calls are where a CUDA run would synchronise,
so counting them on CPU counts the synchronisations a GPU run would make. Two levels:

- Python: ``.item()``, ``.tolist()``, ``.numpy()``, ``bool()/int()/float()`` of a tensor,
  ``np.asarray(tensor)``, printing, ``.cpu()``, and ``.to("cpu")`` from an accelerator. CPU
  tensors serve these without dispatching, so a :class:`~torch.overrides.TorchFunctionMode`
  sees them.
- Dispatcher: ``aten._local_scalar_dense`` and the data-dependent-shape operators (``nonzero``,
  ``masked_select``, ``unique``, ...) that read device memory to size their output, plus
  device-to-host copies when a real accelerator is present.

One host read is one count: ``x.cpu().numpy()`` is the copy (counted) and then a read of host
memory (not counted again), and a Python-level read is not counted a second time by the
dispatcher underneath it. A non-blocking copy to the CPU is not a read by itself; the read that
follows it is.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_READ_METHODS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__array__",
    "__repr__",
    "__format__",
}
_COPY_METHODS = {"cpu", "to"}
# Operators that read device memory on the host (scalar reads, outputs sized by data).
_SYNC_OPS = {
    aten._local_scalar_dense,
    aten.item,
    aten.nonzero,
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
    aten.bincount,
}
_PACKAGE = str(Path(__file__).resolve().parent.parent / "nemo_moe_metrics")


def _copy_target_is_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.cpu``/``Tensor.to`` here is a blocking copy to the host.

    ``.cpu()`` exists only to bring data to the host: always a read. ``.to(device)`` is one only
    when it really leaves an accelerator: code moving a tensor to its collective's device calls
    ``.to(cpu)`` under gloo, a no-op that under NCCL is ``.to(cuda)``, not a read.
    """
    if name == "cpu":
        return True
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if source is None or source.device.type == "cpu" or kwargs.get("non_blocking", False):
        return False
    device = kwargs.get("device")
    if device is None:
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                device = a
                break
            if isinstance(a, torch.Tensor):  # .to(other): other's device
                device = a.device
                break
    if device is None:
        return False
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def _has_bool_index(args: tuple) -> bool:
    # x[mask] sizes its output by the mask's contents: a nonzero() underneath.
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _call_site() -> str:
    """The innermost frame in nemo_moe_metrics (else the innermost outside torch and this file).

    The CPU shims' TorchFunctionMode sits between megatron-core and torch; its frame is skipped
    so megatron's own reads are named by megatron's file.
    """
    frames = [f for f in traceback.extract_stack()[:-3] if not f.filename.endswith("cpu_shims.py")]
    for frame in reversed(frames):
        if frame.filename.startswith(_PACKAGE):
            rel = Path(frame.filename).relative_to(Path(_PACKAGE).parent)
            return f"{rel}:{frame.lineno}"
    for frame in reversed(frames):
        name = frame.filename
        if "/torch/" not in name and not name.endswith("host_reads.py"):
            return f"{Path(name).name}:{frame.lineno}"
    return "?"


class _State:
    def __init__(self) -> None:
        self.total = 0
        self.by_site: Counter[str] = Counter()
        self.suppress = 0  # > 0 while a counted Python-level read runs
        self.copied: dict[int, weakref.ref] = {}  # host copies already counted

    def count(self, what: str) -> None:
        self.total += 1
        self.by_site[f"{what} @ {_call_site()}"] += 1

    def is_counted_copy(self, t: Any) -> bool:
        ref = self.copied.get(id(t))
        return ref is not None and ref() is t


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        state = self.state
        is_read = name in _READ_METHODS and args and isinstance(args[0], torch.Tensor)
        is_copy = name in _COPY_METHODS and _copy_target_is_cpu(name, args, kwargs)
        if not (is_read or is_copy) or state.suppress:
            return func(*args, **kwargs)
        if is_read and state.is_counted_copy(args[0]):
            return func(*args, **kwargs)  # reading the host copy already counted
        state.count(f"Tensor.{name}")
        state.suppress += 1
        try:
            out = func(*args, **kwargs)
        finally:
            state.suppress -= 1
        if is_copy and isinstance(out, torch.Tensor):
            state.copied[id(out)] = weakref.ref(out)
        return out


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        if not state.suppress:
            packet = func.overloadpacket
            if packet in _SYNC_OPS:
                state.count(f"aten.{packet.__name__}")
            elif packet in (aten.index, aten.index_put, aten.index_put_) and _has_bool_index(args):
                state.count(f"aten.{packet.__name__} with a boolean mask")
            elif packet in (aten._to_copy, aten.copy_):
                src = args[1] if packet is aten.copy_ else args[0]
                dst = args[0].device if packet is aten.copy_ else kwargs.get("device")
                if (
                    dst is not None
                    and torch.device(dst).type == "cpu"
                    and isinstance(src, torch.Tensor)
                    and src.device.type != "cpu"
                    and not kwargs.get("non_blocking", False)
                ):
                    state.count(f"aten.{packet.__name__} device-to-host")
        return func(*args, **kwargs)


class HostReadCounter:
    """Context manager counting host reads inside it; ``mark()`` starts a new segment.

    ``total`` counts everything; ``segments`` holds the counts between marks (the first segment
    starts at entry); ``by_site`` names each read and where in the package it happened.
    """

    def __init__(self) -> None:
        self._state = _State()
        self._modes: tuple[Any, Any] | None = None
        self._marks: list[int] = []

    def __enter__(self) -> HostReadCounter:
        self._modes = (_FunctionLevel(self._state), _DispatchLevel(self._state))
        self._modes[0].__enter__()
        self._modes[1].__enter__()
        self._marks = [0]
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._modes is not None
        self._modes[1].__exit__(*exc)
        self._modes[0].__exit__(*exc)
        self._modes = None

    def mark(self) -> None:
        """Close the current segment and start the next (e.g. at each microbatch)."""
        self._marks.append(self._state.total)

    @property
    def total(self) -> int:
        """Host reads counted so far."""
        return self._state.total

    @property
    def segments(self) -> list[int]:
        """Host reads per segment: from entry to the first mark, between marks, to now."""
        bounds = [*self._marks, self._state.total]
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]

    @property
    def by_site(self) -> dict[str, int]:
        """``"Tensor.tolist @ nemo_moe_metrics/moe/aux_loss.py:351" -> count``."""
        return dict(self._state.by_site)
