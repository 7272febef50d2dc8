"""The expert-load store: each logged step's [MoE layers x experts] token counts, appended.

``metrics.jsonl`` keeps scalars; the ``moe/expert_loads`` table goes here, about 57 KB per step
at 94 x 256 instead of 630 KB of JSON rows. Written with numpy and the standard library's zlib
(both already needed, nothing new to install): counts are stored in the smallest unsigned
integer type that holds them, byte-shuffled (high bytes of all counts together, then the next
bytes, ...: counts of one step share their high bytes, so zlib level 1 compresses them in
about 1 ms), and framed as one record per step. Every record decodes on its own, so a damaged
record costs that step and nothing else (docs/en/storage.md says why no step is coded
against another).

File layout (little endian)::

    b"NMMELS1\\n"                                     file magic, once
    then per step: a record header + payload; version 2 (written since format 2):
        b"ELR2"  step:u64  layers:u32  experts:u32  itemsize:u8  codec:u8  flags:u16
        payload_bytes:u32  crc32(payload):u32  crc32(header[:32]):u32       36 bytes
    version 1 (earlier stores, still read):
        b"ELR1"  step:u64  layers:u32  experts:u32  itemsize:u8  codec:u8  pad:u16
        payload_bytes:u32  crc32(header[:28] + payload):u32                 32 bytes
    payload (codec 1) = zlib(layer ids as int32, [widths as uint32,] then the shuffled counts)

``flags`` (version 2; version 1's ``pad`` is always 0): bit 0 (``_FLAG_WIDTHS``) says the
payload carries each layer's expert count (``widths``, uint32 per layer) after the layer ids.
It is set only when the layers differ (a model with 4 experts in one MoE layer and 8 in
another): the counts stay a ``[layers x widest]`` grid whose cells beyond a layer's width are
0 and are no expert. Records without it (every earlier one) have every column real. A record
with a flag this code does not know was written by a newer version: readers skip it and say
so, and a writer never cuts it.

Crash safety matches ``metrics.jsonl``: each record goes out in one ``write`` and is fsync'd
before ``append`` returns, so every step whose log call returned can be read back after a
``kill -9``. Damage never costs more than the damaged record: a record whose payload fails its
checksum is skipped; a damaged header (version 2 headers carry their own checksum) is skipped
by searching forward for the next valid record header, and everything after it is kept. A
record cut short at the end of the file (a crash mid-write) is skipped by readers and cut off
by the next writer that opens the file (a resumed run); nothing else is ever cut. Readers say
what they skipped (a warning, or the ``skipped`` list they are given).

The headers double as an index: ``read_expert_loads`` first walks the headers (36 bytes read
per step, the payloads are skipped by seeking), then decodes only the steps asked for, one at
a time, so reading a step window of a 10,000-step run neither decodes nor holds the rest.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.metric_names import EXPERT_LOADS
from nemo_moe_metrics.sinks.base import Metrics

STORE_FILE = "expert_loads.bin"
#: The record version this code writes (1: the first format, still read).
FORMAT_VERSION = 2

_MAGIC = b"NMMELS1\n"
#: Bytes of the file header: a store of this size holds no record yet.
FILE_HEADER_SIZE = len(_MAGIC)
_TAGS = {b"ELR1": 1, b"ELR2": 2}
_HEADER_V1 = struct.Struct("<4sQIIBBHII")  # 32 bytes
_HEADER_V2 = struct.Struct("<4sQIIBBHIII")  # 36 bytes
_HEADER_SIZE = {1: _HEADER_V1.size, 2: _HEADER_V2.size}
_CODEC_ZLIB_SHUFFLE = 1
#: Header flag: the payload holds each layer's expert count (uint32 [L]) after the layer ids.
_FLAG_WIDTHS = 1
_KNOWN_FLAGS = _FLAG_WIDTHS
_ITEMSIZES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# A header that claims more than this is garbage (a torn or foreign file), not a real step.
_MAX_CELLS = 1 << 28
_MAX_PAYLOAD = 8 * _MAX_CELLS + (1 << 20)
# How far ahead of a damaged spot the reader looks for the next record header, per read.
_SEARCH_CHUNK = 1 << 20

__all__ = [
    "FILE_HEADER_SIZE",
    "FORMAT_VERSION",
    "STORE_FILE",
    "ExpertLoadSink",
    "ExpertLoadStore",
    "StoreError",
    "StoreScan",
    "StoredBlock",
    "StoredStep",
    "read_expert_load_blocks",
    "read_expert_loads",
    "scan_store",
    "store_path",
    "table_to_counts",
    "table_to_counts_and_widths",
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
    version: int = 1
    flags: int = 0

    @property
    def newer(self) -> bool:
        """Written by a newer version (a flag this code does not know): not decoded."""
        return bool(self.flags & ~_KNOWN_FLAGS)

    @property
    def header_size(self) -> int:
        return _HEADER_SIZE[self.version]

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.payload_bytes


@dataclass(frozen=True)
class Gap:
    """Bytes of the store that hold no readable record (damage, or a write cut short)."""

    start: int
    end: int
    after_step: int | None  # the last readable record before it
    before_step: int | None  # the first readable record after it (None: the end of the file)
    step: int | None = None  # the step its header names, when the header is intact

    def describe(self) -> str:
        """What was skipped, in the terms of steps."""
        size = f"{self.end - self.start} unreadable byte(s) at offset {self.start}"
        if self.before_step is None:
            which = f" (step {self.step})" if self.step is not None else ""
            return f"a record cut short at the end of the file{which}: {size}, a crash mid-write"
        around = (
            f"between steps {self.after_step} and {self.before_step}"
            if self.after_step is not None
            else f"before step {self.before_step}"
        )
        return f"{size} {around}: a damaged record, skipped; every record after it is kept"


@dataclass
class StoreScan:
    """The result of walking a store's record headers."""

    entries: list[_Entry]  # readable headers, in file order
    end: int  # where the last readable record ends
    gaps: list[Gap] = field(default_factory=list)
    torn_magic: bool = False  # the file is shorter than its 8-byte magic

    @property
    def tail(self) -> Gap | None:
        """The gap at the end of the file (a write cut short), if any."""
        return self.gaps[-1] if self.gaps and self.gaps[-1].before_step is None else None

    @property
    def steps(self) -> list[int]:
        """The steps of the readable records, in file order."""
        return [e.step for e in self.entries]


def _parse_header(raw: bytes, offset: int) -> _Entry | None:
    """The record header at ``offset`` if it is one (v2: its own checksum holds)."""
    version = _TAGS.get(raw[:4])
    if version is None or len(raw) < _HEADER_SIZE[version]:
        return None
    if version == 2:
        tag, step, layers, experts, itemsize, codec, flags, nbytes, crc, hcrc = _HEADER_V2.unpack(
            raw[: _HEADER_V2.size]
        )
        if zlib.crc32(raw[:32]) != hcrc:
            return None
    else:
        tag, step, layers, experts, itemsize, codec, _pad, nbytes, crc = _HEADER_V1.unpack(
            raw[: _HEADER_V1.size]
        )
        flags = 0
    if (
        itemsize not in _ITEMSIZES
        or codec != _CODEC_ZLIB_SHUFFLE
        or layers * experts > _MAX_CELLS
        or nbytes > _MAX_PAYLOAD
    ):
        return None
    return _Entry(step, offset, layers, experts, itemsize, codec, nbytes, crc, version, flags)


def _read_header(f: Any, offset: int) -> _Entry | None:
    f.seek(offset)
    return _parse_header(f.read(_HEADER_V2.size), offset)


def _verified(f: Any, e: _Entry, size: int) -> bool:
    """A candidate record found by searching is taken only when it is whole and checks out."""
    return e.end <= size and (e.version == 2 or _payload_ok(f, e))


def _payload_ok(f: Any, e: _Entry) -> bool:
    f.seek(e.offset)
    raw = f.read(e.header_size + e.payload_bytes)
    return _check(memoryview(raw), e)


def _check(view: memoryview, e: _Entry) -> bool:
    payload = view[e.header_size :]
    if len(payload) != e.payload_bytes:
        return False
    if e.version == 1:
        return zlib.crc32(payload, zlib.crc32(view[:28])) == e.crc
    return zlib.crc32(payload) == e.crc


def _search(f: Any, start: int, size: int) -> _Entry | None:
    """The first valid, whole record header at or after ``start``."""
    pos = start
    while pos < size:
        f.seek(pos)
        chunk = f.read(_SEARCH_CHUNK + _HEADER_V2.size)
        hits = sorted(j for tag in _TAGS for j in _find_all(chunk, tag) if j < _SEARCH_CHUNK)
        for j in hits:
            e = _read_header(f, pos + j)
            if e is not None and _verified(f, e, size):
                return e
        pos += _SEARCH_CHUNK
    return None


def _find_all(data: bytes, tag: bytes) -> Iterator[int]:
    i = data.find(tag)
    while i >= 0:
        yield i
        i = data.find(tag, i + 1)


def scan_store(f: Any, size: int | None = None) -> StoreScan:
    """Walk the record headers of an open store (payloads are skipped by seeking, not read)
    and say what is unreadable. Raises :class:`StoreError` when the file is not a store."""
    size = os.fstat(f.fileno()).st_size if size is None else size
    f.seek(0)
    head = f.read(len(_MAGIC))
    if head != _MAGIC:
        if _MAGIC.startswith(head):  # empty, or the magic itself was torn
            return StoreScan([], len(head), torn_magic=bool(head))
        raise StoreError(
            f"{getattr(f, 'name', 'file')} is not an expert-load store (it does not start with "
            f"{_MAGIC!r}); point the reader at the {STORE_FILE} file of a run directory"
        )
    scan = StoreScan([], len(_MAGIC))
    offset = len(_MAGIC)
    while offset < size:
        e = _read_header(f, offset)
        if e is not None and e.end <= size:
            scan.entries.append(e)
            offset = scan.end = e.end
            continue
        # Damage, or a write cut short: look for the next record; a version-1 header cannot
        # prove its own size, so a v1 record just before the damage is checked (it may be the
        # damaged one) and the search starts inside it.
        start = offset
        prev = scan.entries[-1] if scan.entries else None
        if prev is not None and prev.version == 1 and not _payload_ok(f, prev):
            scan.entries.pop()
            start = prev.offset
            scan.end = start
        found = _search(f, start + 1, size)
        after = scan.entries[-1].step if scan.entries else None
        if found is None:
            step = e.step if e is not None else None
            scan.gaps.append(Gap(start, size, after, None, step))
            break
        scan.gaps.append(Gap(start, found.offset, after, found.step))
        offset = found.offset
    return scan


def _scan(f: Any, size: int) -> tuple[list[_Entry], int, str | None]:
    """``(readable records, end of the last one, why the walk stopped early or None)``."""
    scan = scan_store(f, size)
    why = "torn file header" if scan.torn_magic else None
    if scan.gaps:
        why = scan.gaps[-1].describe()
    return scan.entries, scan.end, why


def _decode(
    f: Any, e: _Entry, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """``(layer_ids int64 [L], counts int64 [L, E], widths int64 [L] or None)`` of one record
    (widths None: every layer has all E experts); None if its CRC fails.

    ``f`` is a binary file or a file descriptor (read with ``os.pread``: several threads may
    decode from one descriptor); the counts go into ``out`` (int64 ``[L, E]``) when given.
    """
    if e.newer:
        return None
    n = e.header_size + e.payload_bytes
    if isinstance(f, int):
        raw = os.pread(f, n, e.offset)
    else:
        f.seek(e.offset)
        raw = f.read(n)
    view = memoryview(raw)
    if not _check(view, e):
        return None
    n_ids = 4 * e.layers
    n_widths = 4 * e.layers if e.flags & _FLAG_WIDTHS else 0
    cells = e.layers * e.experts
    size = n_ids + n_widths + cells * e.itemsize
    # Never more than the header declares (+1 byte to tell a longer stream): a crafted payload
    # of compressed zeros cannot make the reader inflate gigabytes.
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(view[e.header_size :], size + 1)
    except zlib.error:
        return None
    if len(data) != size or not inflater.eof:
        return None
    layer_ids = np.frombuffer(data, dtype="<i4", count=e.layers).astype(np.int64)
    widths = None
    if n_widths:
        widths = np.frombuffer(data, dtype="<u4", count=e.layers, offset=n_ids).astype(np.int64)
        if widths.size and (widths.min() < 1 or widths.max() > e.experts):
            return None
    planes = np.frombuffer(data, dtype=np.uint8, offset=n_ids + n_widths).reshape(e.itemsize, cells)
    counts = np.empty((e.layers, e.experts), dtype=np.int64) if out is None else out
    flat = counts.reshape(cells)
    # Undo the byte shuffle: count = sum of plane k << 8k (plane 0 holds the low bytes).
    # Shifting whole planes is about 3x faster than transposing the uint8 planes.
    np.copyto(flat, planes[-1])
    for k in range(e.itemsize - 2, -1, -1):
        flat <<= 8
        flat |= planes[k]
    return layer_ids, counts, widths


def _encode(
    step: int, layer_ids: np.ndarray, counts: np.ndarray, widths: np.ndarray | None = None
) -> bytes:
    """One record; ``widths`` (each layer's expert count) only when the layers differ."""
    top = int(counts.max()) if counts.size else 0
    itemsize = next(s for s in (1, 2, 4, 8) if top <= np.iinfo(_ITEMSIZES[s]).max)
    typed = counts.astype(np.dtype(_ITEMSIZES[itemsize]).newbyteorder("<"), copy=False)
    # Byte shuffle: all low bytes, then all next bytes, ... (high bytes are mostly equal).
    shuffled = np.ascontiguousarray(typed.reshape(-1).view(np.uint8).reshape(-1, itemsize).T)
    packer = zlib.compressobj(1)
    payload = packer.compress(layer_ids.astype("<i4").tobytes())
    if widths is not None:
        payload += packer.compress(widths.astype("<u4").tobytes())
    payload += packer.compress(shuffled) + packer.flush()
    L, E = counts.shape
    flags = 0 if widths is None else _FLAG_WIDTHS
    fields = (b"ELR2", step, L, E, itemsize, _CODEC_ZLIB_SHUFFLE, flags, len(payload))
    head = struct.pack("<4sQIIBBHII", *fields, zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _checked_widths(widths: Any, counts: np.ndarray) -> np.ndarray | None:
    """``widths`` as int64 [L] when some layer has fewer experts than ``counts`` has columns;
    None when every layer has them all (the record needs no widths)."""
    if widths is None:
        return None
    w = np.asarray(widths)
    n_layers, n_experts = counts.shape
    if w.shape != (n_layers,) or (w.size and w.dtype.kind not in "iu"):
        raise StoreError(
            f"widths must be one int per layer ({n_layers}), each layer's number of experts; "
            f"got {widths!r}"
        )
    if not w.size or int(w.min()) == n_experts == int(w.max()):
        return None
    if int(w.min()) < 1 or int(w.max()) > n_experts:
        raise StoreError(
            f"widths must be in 1..{n_experts} (the counts have {n_experts} columns), got "
            f"{w.tolist()}"
        )
    beyond = np.arange(n_experts) >= w[:, None]
    if counts[beyond].any():
        row = int(np.nonzero((counts * beyond).any(axis=1))[0][0])
        raise StoreError(
            f"layer row {row} has {int(w[row])} experts but tokens in a column beyond them; "
            "counts past a layer's width must be 0 (or pass the layer's real width)"
        )
    return w.astype(np.int64)


class ExpertLoadStore:
    """Append one step's ``[layers x experts]`` integer counts (and layer ids) to ``path``.

    Opening an existing store appends to it (a resumed run); a record cut short at its end by
    a crash is cut off first (with a warning), and nothing before it. Each ``append`` is
    durable (written and fsync'd) before it returns.
    """

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                size = os.fstat(fd).st_size
                scan = scan_store(f, size)
                end = _cut_point(f, scan, size)
            for gap in scan.gaps:
                if gap.before_step is not None:
                    warnings.warn(f"{self.path}: {gap.describe()}", RuntimeWarning, stacklevel=2)
            if end < len(_MAGIC):
                os.ftruncate(fd, 0)
                os.write(fd, _MAGIC)
            elif end < size:
                warnings.warn(
                    f"{self.path}: cut {size - end} byte(s) at its end, a record torn by a "
                    "crash; every complete step is kept",
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

    def append(
        self,
        step: int,
        layer_ids: Sequence[int],
        counts: np.ndarray,
        widths: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Store ``counts[i, e]``: tokens routed to expert ``e`` of MoE layer ``layer_ids[i]``.

        ``widths[i]``: how many experts layer ``i`` has, when the layers differ (its cells
        beyond that are 0 and no expert); None, or every width equal to ``counts``' columns,
        stores the record as before (every column an expert).
        """
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
        record = _encode(int(step), ids, arr, _checked_widths(widths, arr))
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


def _cut_point(f: Any, scan: StoreScan, size: int) -> int:
    """Where a writer may cut the file: after the last record that decodes. Only the tail goes:
    a record cut short, or last records failing their checksum (a machine crash can leave
    zeros there); damage followed by readable records is left for readers to skip."""
    if scan.torn_magic or size < len(_MAGIC):
        return 0
    end = scan.tail.start if scan.tail is not None else size
    entries = list(scan.entries)
    while (
        entries
        and entries[-1].end == end
        and not entries[-1].newer
        and _decode(f, entries[-1]) is None
    ):
        end = entries.pop().offset
    return max(end, len(_MAGIC))


def cut_store_from(path: Path, step: int) -> list[int]:
    """Cut the records at the end of the store whose step is ``>= step`` (a resumed run logs
    them again); returns their steps. Records before a lower step stay (readers keep the
    latest timeline), and so does a record cut short (the next writer cuts it)."""
    with open(path, "r+b") as f:
        scan = scan_store(f)
        if scan.tail is not None:
            return []
        cut: list[int] = []
        end = scan.end
        for e in reversed(scan.entries):
            if e.step < step or e.end != end:
                break
            cut.append(e.step)
            end = e.offset
        if cut:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return cut[::-1]


class _Stored(tuple):
    """``(steps or step, layer_ids, counts)`` that also carries ``.widths``: callers that
    unpack three values keep working."""

    widths: np.ndarray

    def __new__(cls, first: Any, layer_ids: np.ndarray, counts: np.ndarray, widths: np.ndarray):
        self = super().__new__(cls, (first, layer_ids, counts))
        self.widths = widths
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (*self, self.widths)

    @property
    def layer_ids(self) -> np.ndarray:
        return self[1]

    @property
    def counts(self) -> np.ndarray:
        return self[2]


class StoredStep(_Stored):
    """One stored step: unpacks as ``(step, layer_ids, counts)``; ``.widths`` (int64 [L]) is
    each layer's number of experts (``E`` for every layer unless the layers differ, when
    ``counts[i, widths[i]:]`` are 0 and no expert)."""

    @property
    def step(self) -> int:
        return self[0]


class StoredBlock(_Stored):
    """Logged steps of one set of layers: unpacks as ``(steps [K], layer_ids [L], counts
    [K, L, E])``; ``.widths`` (int64 [L]) as for :class:`StoredStep`."""

    @property
    def steps(self) -> np.ndarray:
        return self[0]


def read_expert_loads(
    path: Path, steps: slice | None = None, *, skipped: list[str] | None = None
) -> Iterator[StoredStep]:
    """Yield ``(step, layer_ids int64 [L], counts int64 [L, E])`` in step order, one at a time
    (a :class:`StoredStep`: ``.widths`` says each layer's number of experts).

    ``steps`` picks step numbers ``start <= step < stop`` (either end open when None) without
    decoding the others; ``slice.step = k`` keeps every k-th logged step of that window. When a
    resumed run logged a step at or below one already stored, the earlier records from that
    step on are dropped (they belong to the timeline the restart abandoned), as for the JSONL.
    What is skipped (a torn tail, a damaged record, one failing its checksum, steps a restart
    superseded) is said in a warning each, or appended to ``skipped`` when it is given.
    """
    path = Path(path)
    _check_steps(steps)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; the expert-load store is written by runs with the JSONL sink "
            "on (logger.jsonl_enabled=true) and MoE metrics on (track_moe_metrics=true)"
        )
    say = _teller(path, skipped)
    with path.open("rb") as f:
        timeline = _index(f, steps, say)
        bad: list[int] = []
        for e in timeline:
            decoded = _decode(f, e)
            if decoded is None:
                bad.append(e.step)
                continue
            ids, counts, widths = decoded
            yield StoredStep(e.step, ids, counts, _full(widths, e))
        _say_bad(say, bad)


def _check_steps(steps: slice | None) -> None:
    if steps is not None and not isinstance(steps, slice):
        raise TypeError(f"steps must be a slice of step numbers or None, got {steps!r}")
    if steps is not None and steps.step is not None and steps.step < 1:
        raise ValueError(f"steps.step must be >= 1 (keep every k-th logged step), got {steps.step}")


def _teller(path: Path, skipped: list[str] | None) -> Callable[[str], None]:
    def say(text: str) -> None:
        if skipped is not None:
            skipped.append(f"{path.name}: {text}")
        else:
            warnings.warn(f"{path}: {text}", stacklevel=4)

    return say


def _say_bad(say: Callable[[str], None], bad: list[int]) -> None:
    if bad:
        say(
            f"skipped {len(bad)} damaged record(s) (a payload failing its checksum, or not "
            f"inflating to the size its header declares): "
            f"step(s) {steps_text(bad)}"
        )


def steps_text(steps: list[int], limit: int = 12) -> str:
    """``3, 5, 9–14``: sorted steps, runs of consecutive ones joined."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    parts = [f"{r[0]}" if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs]
    return ", ".join(parts[:limit]) + (
        f", ... ({len(parts) - limit} more)" if len(parts) > limit else ""
    )


def _index(f: Any, steps: slice | None, say: Callable[[str], None]) -> list[_Entry]:
    """The records of the run as it finally went, in step order, restricted to ``steps``."""
    scan = scan_store(f)
    if scan.torn_magic:
        say("the file is shorter than its 8-byte header (cut short before any record)")
    for gap in scan.gaps:
        say(gap.describe())
    timeline: list[_Entry] = []
    superseded: list[int] = []
    for e in scan.entries:
        while timeline and timeline[-1].step >= e.step:
            superseded.append(timeline.pop().step)
        timeline.append(e)
    if superseded:
        say(
            f"step(s) {steps_text(sorted(superseded))} stored again later (a restart from an "
            "earlier step): the later records are read"
        )
    newer = [e for e in timeline if e.newer]
    if newer:
        flags = sorted({f"0x{e.flags:04x}" for e in newer})
        say(
            f"step(s) {steps_text([e.step for e in newer])} written by a newer version of "
            f"nemo_moe_metrics (record flags {', '.join(flags)}): not read; upgrade "
            "nemo_moe_metrics to read them"
        )
        timeline = [e for e in timeline if not e.newer]
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
    prepare: Callable[..., Any] | None = None,
    widths: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[Any]:
    """Like ``read_expert_loads``, but ``block`` logged steps at a time: yields ``(steps int64
    [K], layer_ids int64 [L], counts int64 [K, L, E])`` with ``K <= block``, in step order (a
    :class:`StoredBlock`, with ``.widths``); a block ends early where the layer ids, the
    layers' widths or the shape change. With ``workers > 1``, that many threads decode blocks
    ahead of the consumer (zlib and numpy release the GIL, so decoding overlaps the caller's
    work); at most ``2 * workers`` blocks are held at a time. ``prepare(steps, layer_ids,
    counts)``, when given, runs on each block in the decoding thread and its result is yielded
    instead; with ``widths=True`` it is called as ``prepare(steps, layer_ids, counts,
    widths)``. ``skipped`` as for ``read_expert_loads``.
    """
    path = Path(path)
    if block < 1 or workers < 1:
        raise ValueError(f"block and workers must be >= 1, got {block} and {workers}")
    _check_steps(steps)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (no expert-load store)")
    say = _teller(path, skipped)
    with path.open("rb") as f:
        timeline = _index(f, steps, say)
        # Blocks of records that share one shape (a change of shape starts a new block).
        groups: list[list[_Entry]] = []
        for e in timeline:
            g = groups[-1] if groups else None
            if g and len(g) < block and (g[0].layers, g[0].experts) == (e.layers, e.experts):
                g.append(e)
            else:
                groups.append([e])
        fd = f.fileno()
        bad: list[int] = []
        if workers == 1:
            for g in groups:
                decoded, b = _decode_block(fd, g, prepare, widths)
                bad += b
                yield from decoded
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(workers, thread_name_prefix="nmm-store") as pool:
                pending = [
                    pool.submit(_decode_block, fd, g, prepare, widths)
                    for g in groups[: 2 * workers]
                ]
                nxt = len(pending)
                while pending:
                    decoded, b = pending.pop(0).result()
                    if nxt < len(groups):
                        pending.append(pool.submit(_decode_block, fd, groups[nxt], prepare, widths))
                        nxt += 1
                    bad += b
                    yield from decoded
        _say_bad(say, bad)


def _decode_block(
    fd: int,
    entries: list[_Entry],
    prepare: Callable[..., Any] | None = None,
    with_widths: bool = False,
) -> tuple[list[Any], list[int]]:
    """Decode records of one shape into ``[K, L, E]``; split where the layer ids or the
    layers' widths change."""
    e0 = entries[0]
    counts = np.empty((len(entries), e0.layers, e0.experts), dtype=np.int64)
    steps = np.empty(len(entries), dtype=np.int64)
    out: list[StoredBlock] = []
    ids: np.ndarray | None = None
    widths: np.ndarray | None = None
    start = k = 0
    bad: list[int] = []
    for e in entries:
        decoded = _decode(fd, e, counts[k])
        if decoded is None:
            bad.append(e.step)
            continue
        if ids is not None and (
            not np.array_equal(decoded[0], ids) or not _same_widths(decoded[2], widths)
        ):
            out.append(StoredBlock(steps[start:k], ids, counts[start:k], _full(widths, e0)))
            start = k
        ids, widths = decoded[0], decoded[2]
        steps[k] = e.step
        k += 1
    if ids is not None:
        out.append(StoredBlock(steps[start:k], ids, counts[start:k], _full(widths, e0)))
    if prepare is not None:
        if with_widths:
            return [prepare(*item, item.widths) for item in out], bad
        return [prepare(*item) for item in out], bad
    return out, bad


def _same_widths(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _full(widths: np.ndarray | None, e: _Entry) -> np.ndarray:
    return widths if widths is not None else np.full(e.layers, e.experts, np.int64)


def table_to_counts(rows: Sequence[Sequence[Any]]) -> tuple[np.ndarray, np.ndarray]:
    """``(layer_ids [L], counts [L, E])`` from ``moe/expert_loads`` rows (layer, expert, tokens,
    load_percent); layers in order of first appearance, missing cells 0 (``E`` is the widest
    layer's: :func:`table_to_counts_and_widths` says each layer's own)."""
    layer_ids, counts, _ = table_to_counts_and_widths(rows)
    return layer_ids, counts


def table_to_counts_and_widths(
    rows: Sequence[Sequence[Any]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(layer_ids [L], counts [L, E], widths [L])`` from ``moe/expert_loads`` rows, as
    :func:`table_to_counts`; ``widths[i]`` is layer ``i``'s number of experts (its largest
    expert index + 1: the table has one row per real expert), ``E = max(widths)``."""
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return empty, np.zeros((0, 0), dtype=np.int64), empty
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
            return ids, tokens.reshape(grid), np.full(ids.size, n_experts, dtype=np.int64)
    uniq, first, inverse = np.unique(layer, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # layers in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    layer_ids = uniq[order]
    rows_of = rank[inverse.reshape(-1)]
    counts = np.zeros((layer_ids.size, n_experts), dtype=np.int64)
    np.add.at(counts, (rows_of, expert), tokens)
    widths = np.zeros(layer_ids.size, dtype=np.int64)
    np.maximum.at(widths, rows_of, expert + 1)
    return layer_ids, counts, widths


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
        self.store.append(step, *table_to_counts_and_widths(rows))

    def close(self) -> None:
        """Close the store file."""
        self.store.close()
