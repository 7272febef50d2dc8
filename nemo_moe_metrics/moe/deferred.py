"""Router forwards kept for one batched pass: the byte budget, segment ids, and a softmax.

The per-forward hooks (router health, routing consistency, the Hugging Face load-balancing
loss) keep what a forward produced and do their arithmetic once for many forwards: at the
step's end, or sooner when the kept tensors reach :data:`FLUSH_BYTES`. Each device op then
runs once per step instead of once per layer and microbatch (on a CPU, and for a GPU's kernel
launches, the count of ops is the cost at small sizes). Pure tensor arithmetic.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: Bytes of router outputs a tracker keeps before its batched pass: the whole step on small
#: models, a few layers' forwards of a large one.
FLUSH_BYTES = 64 << 20


def segment_ids(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[sum(lengths)]`` int64: for each token of forwards concatenated, its forward's
    position. On an accelerator, fills on the device: no host-to-device copy, whatever the
    lengths; on a CPU, three ops whatever the number of forwards."""
    if device.type == "cpu":
        repeats = torch.tensor(lengths, dtype=torch.int64)
        return torch.arange(len(lengths), dtype=torch.int64).repeat_interleave(
            repeats, output_size=sum(lengths)
        )
    return torch.cat(
        [torch.full((n,), i, dtype=torch.int64, device=device) for i, n in enumerate(lengths)]
    )


class ConstantTensors:
    """Small constant tensors a batched pass uses again each step, kept per value and device.

    ``index(values, device)``: an int64 index (a host-to-device copy once per tuple of values);
    ``ones(shape, dtype, device)``: ones (a fill once per shape); ``segments(lengths, device)``:
    :func:`segment_ids` (a fill per forward once per tuple of lengths); ``segment_starts`` and
    ``blocks``: places in a ``[forwards, width]`` buffer. Varying layouts (lengths
    that change every step) clear the cache past :attr:`LIMIT` entries instead of growing it.
    """

    LIMIT = 256

    def __init__(self) -> None:
        self._kept: dict[tuple, torch.Tensor] = {}

    def _get(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._kept.get(key)
        if found is None:
            if len(self._kept) >= self.LIMIT:
                self._kept.clear()
            found = self._kept[key] = make()
        return found

    def index(self, values: Sequence[int], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``."""
        values = tuple(values)
        return self._get(
            ("index", values, device),
            lambda: torch.tensor(values, dtype=torch.int64).to(device),
        )

    def segments(self, lengths: Sequence[int], device: torch.device) -> torch.Tensor:
        """:func:`segment_ids` of ``lengths``."""
        lengths = tuple(lengths)
        return self._get(("segments", lengths, device), lambda: segment_ids(lengths, device))

    def segment_starts(
        self, lengths: Sequence[int], width: int, device: torch.device
    ) -> torch.Tensor:
        """:func:`segment_ids` of ``lengths`` times ``width``: each token's forward's first
        place in a ``[forwards, width]`` buffer, flattened."""
        lengths = tuple(lengths)
        return self._get(
            ("segment_starts", lengths, width, device),
            lambda: self.segments(lengths, device) * width,
        )

    def blocks(self, starts: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
        """``[len(starts) * width]`` int64: ``start, start + 1, ..., start + width - 1`` for
        each start, concatenated (the places of ``[F, width]`` rows in a flat buffer)."""
        starts = tuple(starts)
        return self._get(
            ("blocks", starts, width, device),
            lambda: (
                self.index(starts, device).unsqueeze(1)
                + torch.arange(width, dtype=torch.int64, device=device)
            ).reshape(-1),
        )

    def ones(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape`` tensor of ones."""
        shape = tuple(shape)
        return self._get(
            ("ones", shape, dtype, device),
            lambda: torch.ones(shape, dtype=dtype, device=device),
        )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class HostStaging:
    """Host memory, allocated once and reused every step, for the tensors trackers keep.

    Kept by reference, a forward's small outputs (router logits, expert ids, masks) outlive
    the large tensors allocated around them, and glibc's heap then takes fresh pages for those
    every step: measured, 3-5 % of a transformers step under activation checkpointing (which
    frees the outputs at once when nothing keeps them), and most of router health's cost in
    the megatron step beyond its own code. :meth:`keep` copies a CPU tensor into this memory
    instead (one copy); a tensor on an accelerator is kept by reference (detached): the
    caching allocator reuses its blocks without cost.

    One staging serves every tracker of a collector (the counts, router health, the
    load-balancing loss): with ``dedup``, what several of them keep from one forward (the
    expert ids, the real-token mask, the router logits) is copied once. Each tracker registers
    its batched pass with :meth:`add_consumer`; :meth:`flush` runs them all, then reuses the
    memory.
    """

    def __init__(self, dedup: bool = False) -> None:
        """``dedup``: a CPU tensor kept again in the round, unchanged, returns its first copy.
        For tensors a forward makes (its outputs): a write that bypasses torch's version
        counter (through numpy, say) into a buffer the caller reuses would go unseen."""
        self.dedup = dedup
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._offset: dict[torch.dtype, int] = {}
        self._used: dict[torch.dtype, int] = {}  # this round, across buffers
        # data_ptr -> (weak reference to the source, its strides, its version, the copy)
        self._copies: dict[int, tuple[Any, tuple[int, ...], int, torch.Tensor]] = {}
        self._consumers: list[Callable[[], None]] = []
        #: bytes kept this round (copies once each, accelerator tensors by their size)
        self.nbytes = 0

    def add_consumer(self, consume: Callable[[], None]) -> None:
        """Register a tracker's pass over what it kept: :meth:`flush` runs it."""
        self._consumers.append(consume)

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` detached (accelerator) or a copy in the staging memory (CPU); never its
        autograd graph. With ``dedup``, a CPU tensor kept before in this round (the same
        memory, strides and version, its source alive) returns the same copy."""
        if not tensor.is_cpu:
            self.nbytes += tensor.numel() * tensor.element_size()
            return tensor.detach()
        if not self.dedup or torch.compiler.is_compiling():  # addresses are not traced
            return self._copy(tensor)
        address = tensor.data_ptr()
        found = self._copies.get(address)
        if found is not None:
            source, strides, version, copy = found
            # A live source holds its memory: no other tensor can have this address, so the
            # same shape, strides and version are the same values.
            if (
                source() is not None
                and copy.shape == tensor.shape
                and copy.dtype == tensor.dtype
                and strides == tensor.stride()
                and version == tensor._version
            ):
                return copy
        copy = self._copy(tensor)
        if address and not tensor.is_inference():  # inference tensors keep no version
            self._copies[address] = (weakref.ref(tensor), tensor.stride(), tensor._version, copy)
        return copy

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype, n = tensor.dtype, tensor.numel()
        buffer, offset = self._buffers.get(dtype), self._offset.get(dtype, 0)
        if buffer is None or offset + n > buffer.numel():
            # Earlier copies stay valid in the old buffer; reset() sizes one for a whole round.
            size = max(n, 2 * (buffer.numel() if buffer is not None else 0), 4096)
            buffer = self._buffers[dtype] = torch.empty(size, dtype=dtype)
            offset = 0
        self._offset[dtype] = offset + n
        self._used[dtype] = self._used.get(dtype, 0) + n
        self.nbytes += n * tensor.element_size()
        strides = tensor.stride() if tensor.is_contiguous() else _contiguous_strides(tensor.shape)
        # One view op (a slice and a view are two): this runs once per kept tensor per forward.
        return buffer.as_strided(tensor.shape, strides, offset).copy_(tensor)

    def flush(self) -> None:
        """Run every consumer's pass over the tensors kept so far, then reuse the memory."""
        for consume in self._consumers:
            consume()
        self.reset()

    def reset(self) -> None:
        """Every copy kept so far is consumed or dropped (every consumer's: a step discarded):
        the memory is free for the next round, one buffer per dtype as large as the round
        just ended needed."""
        for dtype, used in self._used.items():
            if used > self._buffers[dtype].numel():
                self._buffers[dtype] = torch.empty(used, dtype=dtype)
        self._offset, self._used, self._copies, self.nbytes = {}, {}, {}, 0


#: Rows at most this wide take the softmax of their transpose on a CPU (see :func:`softmax`).
NARROW_ROWS = 16


def softmax(z: torch.Tensor, *, log: bool = False) -> torch.Tensor:
    """``softmax(z, -1)`` (``log``: ``log_softmax``) of ``[T, E]`` rows.

    On a CPU, rows of at most :data:`NARROW_ROWS` go through the transposed ``[E, T]`` layout:
    torch's last-dimension kernel vectorises within a row, so at 8 experts it spends most of
    its time on per-row set-up (about 7x slower than the other kernel, which vectorises across
    rows). The values agree with the direct call to a float's last bits.
    """
    fn = torch.log_softmax if log else torch.softmax
    if z.device.type != "cpu" or z.dim() != 2 or z.shape[-1] > NARROW_ROWS:
        return fn(z, dim=-1)
    return fn(z.t(), dim=0).t()
