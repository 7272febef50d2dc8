"""The expert-load store: each logged step's [MoE layers x experts] token counts, appended.

``metrics.jsonl`` keeps scalars; the ``moe/expert_loads`` table goes here, about 50 KB per step
at 94 x 256 instead of 870 KB of JSON rows. Written with numpy and the standard library's zlib
(both already needed, nothing new to install): counts are stored in the smallest unsigned
integer type that holds them, byte-shuffled (high bytes of all counts together, then the next
bytes, ...: counts of one step share their high bytes, so zlib level 1 compresses them 2x in
about 1 ms), and framed as one record per step.

File layout (little endian)::

    b"NMMELS1\\n"                                     file magic, once
    then per step: 32-byte header + payload
        b"ELR1"  step:u64  layers:u32  experts:u32  itemsize:u8  codec:u8  pad:u16
        payload_bytes:u32  crc32(header[:28] + payload):u32
        payload = zlib(layer ids as int32, then the shuffled counts)

Crash safety matches ``metrics.jsonl``: each record goes out in one ``write`` and is fsync'd
before ``append`` returns, so every step whose log call returned can be read back after a
``kill -9``. A record cut short by a crash (a torn tail) is skipped by readers with a warning
and cut off by the next writer that opens the file (a resumed run), never fatal.

The headers double as an index: ``read_expert_loads`` first walks the headers (32 bytes read
per step, the payloads are skipped by seeking), then decodes only the steps asked for, one at
a time, so reading a step window of a 10,000-step run neither decodes nor holds the rest.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.metric_names import EXPERT_LOADS
from nemo_moe_metrics.sinks.base import Metrics

STORE_FILE = "expert_loads.bin"

_MAGIC = b"NMMELS1\n"
_REC = b"ELR1"
_HEADER = struct.Struct("<4sQIIBBHII")  # 32 bytes
_CODEC_ZLIB_SHUFFLE = 1
_ITEMSIZES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# A header that claims more than this is garbage (a torn or foreign file), not a real step.
_MAX_CELLS = 1 << 28

__all__ = [
    "STORE_FILE",
    "ExpertLoadSink",
    "ExpertLoadStore",
    "StoreError",
    "read_expert_load_blocks",
    "read_expert_loads",
    "store_path",
]


class StoreError(ValueError):
    """The file is not an expert-load store, or the data given to it cannot be stored."""


def store_path(run_dir: Path) -> Path:
    """Where a run directory keeps its expert-load store (beside ``metrics.jsonl``)."""
    return Path(run_dir) / STORE_FILE


@dataclass(frozen=True)
class _Entry:
    step: int
    offset: int  # of the record header
    layers: int
    experts: int
    itemsize: int
    codec: int
    payload_bytes: int
    crc: int


def _scan(f: Any, size: int) -> tuple[list[_Entry], int, str | None]:
    """Walk the record headers: (complete records in file order, end of the last one, why the
    walk stopped early or None). Payloads are skipped by seeking, not read."""
    f.seek(0)
    head = f.read(len(_MAGIC))
    if head != _MAGIC:
        if _MAGIC.startswith(head):  # empty, or the magic itself was torn
            return [], len(head), ("torn file header" if head else None)
        raise StoreError(
            f"{getattr(f, 'name', 'file')} is not an expert-load store (it does not start with "
            f"{_MAGIC!r}); point the reader at the {STORE_FILE} file of a run directory"
        )
    entries: list[_Entry] = []
    offset = len(_MAGIC)
    while offset < size:
        f.seek(offset)
        raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            return entries, offset, "torn record header"
        tag, step, layers, experts, itemsize, codec, _pad, nbytes, crc = _HEADER.unpack(raw)
        if (
            tag != _REC
            or itemsize not in _ITEMSIZES
            or codec != _CODEC_ZLIB_SHUFFLE
            or layers * experts > _MAX_CELLS
        ):
            return entries, offset, "unreadable record header"
        end = offset + _HEADER.size + nbytes
        if end > size:
            return entries, offset, "torn record"
        entries.append(_Entry(step, offset, layers, experts, itemsize, codec, nbytes, crc))
        offset = end
    return entries, offset, None


def _decode(
    f: Any, e: _Entry, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(layer_ids int64 [L], counts int64 [L, E])`` of one record; None if its CRC fails.

    ``f`` is a binary file or a file descriptor (read with ``os.pread``: several threads may
    decode from one descriptor); the counts go into ``out`` (int64 ``[L, E]``) when given.
    """
    n = _HEADER.size + e.payload_bytes
    if isinstance(f, int):
        raw = os.pread(f, n, e.offset)
    else:
        f.seek(e.offset)
        raw = f.read(n)
    view = memoryview(raw)
    payload = view[_HEADER.size :]
    if len(payload) != e.payload_bytes or zlib.crc32(payload, zlib.crc32(view[:28])) != e.crc:
        return None
    try:
        data = zlib.decompress(payload)
    except zlib.error:
        return None
    n_ids = 4 * e.layers
    cells = e.layers * e.experts
    if len(data) != n_ids + cells * e.itemsize:
        return None
    layer_ids = np.frombuffer(data, dtype="<i4", count=e.layers).astype(np.int64)
    planes = np.frombuffer(data, dtype=np.uint8, offset=n_ids).reshape(e.itemsize, cells)
    counts = np.empty((e.layers, e.experts), dtype=np.int64) if out is None else out
    flat = counts.reshape(cells)
    # Undo the byte shuffle: count = sum of plane k << 8k (plane 0 holds the low bytes).
    # Shifting whole planes is about 3x faster than transposing the uint8 planes.
    np.copyto(flat, planes[-1])
    for k in range(e.itemsize - 2, -1, -1):
        flat <<= 8
        flat |= planes[k]
    return layer_ids, counts


def _encode(step: int, layer_ids: np.ndarray, counts: np.ndarray) -> bytes:
    top = int(counts.max()) if counts.size else 0
    itemsize = next(s for s in (1, 2, 4, 8) if top <= np.iinfo(_ITEMSIZES[s]).max)
    typed = counts.astype(np.dtype(_ITEMSIZES[itemsize]).newbyteorder("<"), copy=False)
    # Byte shuffle: all low bytes, then all next bytes, ... (high bytes are mostly equal).
    shuffled = np.ascontiguousarray(typed.reshape(-1).view(np.uint8).reshape(-1, itemsize).T)
    payload = zlib.compress(layer_ids.astype("<i4").tobytes() + shuffled.tobytes(), 1)
    L, E = counts.shape
    head = _HEADER.pack(_REC, step, L, E, itemsize, _CODEC_ZLIB_SHUFFLE, 0, len(payload), 0)
    crc = zlib.crc32(head[:28] + payload)
    return head[:28] + struct.pack("<I", crc) + payload


class ExpertLoadStore:
    """Append one step's ``[layers x experts]`` integer counts (and layer ids) to ``path``.

    Opening an existing store appends to it (a resumed run); a torn tail left by a crash is cut
    off first. Each ``append`` is durable (written and fsync'd) before it returns.
    """

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                size = os.fstat(fd).st_size
                entries, end, why = _scan(f, size)
                # The last complete record may still be garbage if the disk lied; check it.
                while entries and _decode(f, entries[-1]) is None:
                    end = entries.pop().offset
                    why = why or "corrupt last record"
            if end < len(_MAGIC):
                os.ftruncate(fd, 0)
                os.write(fd, _MAGIC)
            elif end < size:
                warnings.warn(
                    f"{self.path}: cut {size - end} byte(s) of a record torn by a crash ({why}); "
                    "every complete step is kept",
                    RuntimeWarning,
                    stacklevel=2,
                )
                os.ftruncate(fd, end)
            os.lseek(fd, 0, os.SEEK_END)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def append(self, step: int, layer_ids: Sequence[int], counts: np.ndarray) -> None:
        """Store ``counts[i, e]``: tokens routed to expert ``e`` of MoE layer ``layer_ids[i]``."""
        if self._fd is None:
            raise RuntimeError(f"append() after close() on {self.path}; open a new store")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise StoreError(f"step must be a non-negative int, got {step!r}")
        ids = np.asarray(layer_ids)
        arr = np.asarray(counts)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise StoreError(f"layer_ids must be a 1-D sequence of ints, got {ids!r}")
        if arr.ndim != 2 or arr.shape[0] != ids.size:
            raise StoreError(
                f"counts must have shape [layers, experts] = [{ids.size}, E], got "
                f"{arr.shape}; pass one row of expert counts per layer id"
            )
        if arr.size and arr.dtype.kind not in "iu":
            raise StoreError(
                f"counts must be integers (tokens per expert), got dtype {arr.dtype}; "
                "convert with counts.astype(np.int64) if they are whole numbers"
            )
        if arr.size and arr.min() < 0:
            raise StoreError("counts must be >= 0 (tokens per expert); got a negative count")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise StoreError(f"layer ids must be in 0..2**31-1, got {ids.tolist()}")
        record = _encode(int(step), ids, arr)
        view = memoryview(record)
        while view:  # os.write may write less than asked (signals, full pipes); finish it
            view = view[os.write(self._fd, view) :]
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; closing twice is harmless."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ExpertLoadStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_expert_loads(
    path: Path, steps: slice | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(step, layer_ids int64 [L], counts int64 [L, E])`` in step order, one at a time.

    ``steps`` picks step numbers ``start <= step < stop`` (either end open when None) without
    decoding the others; ``slice.step = k`` keeps every k-th logged step of that window. When a
    resumed run logged a step at or below one already stored, the earlier records from that
    step on are dropped (they belong to the timeline the restart abandoned), as for the JSONL.
    A torn tail (crash mid-write) or a record failing its checksum is skipped with a warning.
    """
    path = Path(path)
    if steps is not None and not isinstance(steps, slice):
        raise TypeError(f"steps must be a slice of step numbers or None, got {steps!r}")
    if steps is not None and steps.step is not None and steps.step < 1:
        raise ValueError(f"steps.step must be >= 1 (keep every k-th logged step), got {steps.step}")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; the expert-load store is written by runs with the JSONL sink "
            "on (logger.jsonl_enabled=true) and MoE metrics on (track_moe_metrics=true)"
        )
    with path.open("rb") as f:
        timeline = _index(f, path, steps)
        bad = 0
        for e in timeline:
            decoded = _decode(f, e)
            if decoded is None:
                bad += 1
                continue
            yield e.step, decoded[0], decoded[1]
        if bad:
            warnings.warn(f"{path}: skipped {bad} record(s) failing their checksum", stacklevel=2)


def _index(f: Any, path: Path, steps: slice | None) -> list[_Entry]:
    """The records of the run as it finally went, in step order, restricted to ``steps``."""
    entries, _end, why = _scan(f, os.fstat(f.fileno()).st_size)
    if why:
        warnings.warn(f"{path}: skipped a {why} at the end (crash mid-write?)", stacklevel=3)
    timeline: list[_Entry] = []
    for e in entries:
        while timeline and timeline[-1].step >= e.step:
            timeline.pop()
        timeline.append(e)
    if steps is not None:
        lo, hi = steps.start, steps.stop
        timeline = [
            e for e in timeline if (lo is None or e.step >= lo) and (hi is None or e.step < hi)
        ][:: steps.step or 1]
    return timeline


def read_expert_load_blocks(
    path: Path,
    steps: slice | None = None,
    *,
    block: int = 32,
    workers: int = 1,
    prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], Any] | None = None,
) -> Iterator[Any]:
    """Like ``read_expert_loads``, but ``block`` logged steps at a time: yields ``(steps int64
    [K], layer_ids int64 [L], counts int64 [K, L, E])`` with ``K <= block``, in step order; a
    block ends early where the layer ids or the shape change. With ``workers > 1``, that many
    threads decode blocks ahead of the consumer (zlib and numpy release the GIL, so decoding
    overlaps the caller's work); at most ``2 * workers`` blocks are held at a time.
    ``prepare(steps, layer_ids, counts)``, when given, runs on each block in the decoding
    thread and its result is yielded instead.
    """
    path = Path(path)
    if block < 1 or workers < 1:
        raise ValueError(f"block and workers must be >= 1, got {block} and {workers}")
    if steps is not None and not isinstance(steps, slice):
        raise TypeError(f"steps must be a slice of step numbers or None, got {steps!r}")
    if steps is not None and steps.step is not None and steps.step < 1:
        raise ValueError(f"steps.step must be >= 1 (keep every k-th logged step), got {steps.step}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (no expert-load store)")
    with path.open("rb") as f:
        timeline = _index(f, path, steps)
        # Blocks of records that share one shape (a change of shape starts a new block).
        groups: list[list[_Entry]] = []
        for e in timeline:
            g = groups[-1] if groups else None
            if g and len(g) < block and (g[0].layers, g[0].experts) == (e.layers, e.experts):
                g.append(e)
            else:
                groups.append([e])
        fd = f.fileno()
        bad = 0
        if workers == 1:
            for g in groups:
                decoded, n_bad = _decode_block(fd, g, prepare)
                bad += n_bad
                yield from decoded
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(workers, thread_name_prefix="nmm-store") as pool:
                pending = [
                    pool.submit(_decode_block, fd, g, prepare) for g in groups[: 2 * workers]
                ]
                nxt = len(pending)
                while pending:
                    decoded, n_bad = pending.pop(0).result()
                    if nxt < len(groups):
                        pending.append(pool.submit(_decode_block, fd, groups[nxt], prepare))
                        nxt += 1
                    bad += n_bad
                    yield from decoded
        if bad:
            warnings.warn(f"{path}: skipped {bad} record(s) failing their checksum", stacklevel=2)


def _decode_block(
    fd: int, entries: list[_Entry], prepare: Callable[..., Any] | None = None
) -> tuple[list[Any], int]:
    """Decode records of one shape into ``[K, L, E]``; split where the layer ids change."""
    e0 = entries[0]
    counts = np.empty((len(entries), e0.layers, e0.experts), dtype=np.int64)
    steps = np.empty(len(entries), dtype=np.int64)
    out: list[Any] = []
    ids: np.ndarray | None = None
    start = k = bad = 0
    for e in entries:
        decoded = _decode(fd, e, counts[k])
        if decoded is None:
            bad += 1
            continue
        if ids is not None and not np.array_equal(decoded[0], ids):
            out.append((steps[start:k], ids, counts[start:k]))
            start = k
        ids = decoded[0]
        steps[k] = e.step
        k += 1
    if ids is not None:
        out.append((steps[start:k], ids, counts[start:k]))
    if prepare is not None:
        return [prepare(*item) for item in out], bad
    return out, bad


def table_to_counts(rows: Sequence[Sequence[Any]]) -> tuple[np.ndarray, np.ndarray]:
    """``(layer_ids [L], counts [L, E])`` from ``moe/expert_loads`` rows (layer, expert, tokens,
    load_percent); layers in order of first appearance, missing cells 0."""
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
    # One C-level pass per column (map + itemgetter): about 3x faster than a generator.
    layer, expert, tokens = (
        np.fromiter(map(itemgetter(k), rows), dtype=np.int64, count=len(rows)) for k in (0, 1, 2)
    )
    if expert.min() < 0 or layer.min() < 0:
        raise StoreError("moe/expert_loads has a negative layer or expert index")
    n_experts = int(expert.max()) + 1
    if layer.size % n_experts == 0:
        # The worker's layout: every layer's experts 0..E-1 in order; no sort, no scatter.
        grid = (layer.size // n_experts, n_experts)
        ids = layer[::n_experts]
        if (
            np.array_equal(expert.reshape(grid), np.broadcast_to(np.arange(n_experts), grid))
            and np.array_equal(layer.reshape(grid), np.broadcast_to(ids[:, None], grid))
            and np.unique(ids).size == ids.size
        ):
            return ids, tokens.reshape(grid)
    uniq, first, inverse = np.unique(layer, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # layers in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    layer_ids = uniq[order]
    counts = np.zeros((layer_ids.size, n_experts), dtype=np.int64)
    np.add.at(counts, (rank[inverse.reshape(-1)], expert), tokens)
    return layer_ids, counts


class ExpertLoadSink:
    """A sink that writes each ``table_every``-th step's ``moe/expert_loads`` to the store."""

    def __init__(self, path: Path, *, table_every: int = 1, fsync: bool = True) -> None:
        if isinstance(table_every, bool) or not isinstance(table_every, int) or table_every < 1:
            raise ValueError(f"table_every must be an int >= 1, got {table_every!r}")
        self.table_every = table_every
        self.store = ExpertLoadStore(path, fsync=fsync)

    def wants_tables(self, step: int) -> bool:
        """Whether ``step`` is on the table cadence."""
        return step % self.table_every == 0

    def log(self, metrics: Metrics, step: int) -> None:
        """Append the step's counts when it has a table and ``step`` is on the cadence."""
        rows = metrics.get(EXPERT_LOADS)
        if rows is None or step % self.table_every:
            return
        layer_ids, counts = table_to_counts(rows)
        self.store.append(step, layer_ids, counts)

    def close(self) -> None:
        """Close the store file."""
        self.store.close()
