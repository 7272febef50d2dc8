"""The expert-load store's file format: record headers, encoding and decoding one step,
walking the headers of a file (:func:`scan_store`) and saying what is unreadable.

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
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import COUNT_BOUND, MAX_STEP, LimitError, check_shape

STORE_FILE = "expert_loads.bin"
#: The rollout engine's own expert loads: a second store of the same format beside training's
#: (runs written before it have none; readers of a run without it see no rollout phase).
ROLLOUT_STORE_FILE = "rollout_expert_loads.bin"
#: Which file holds each phase's loads.
PHASE_FILES = {"train": STORE_FILE, "rollout": ROLLOUT_STORE_FILE}
#: The record version this code writes (1: the first format, still read).
FORMAT_VERSION = 2

MAGIC = b"NMMELS1\n"
#: Bytes of the file header: a store of this size holds no record yet.
FILE_HEADER_SIZE = len(MAGIC)
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


class StoreError(ValueError):
    """The file is not an expert-load store, or the data given to it cannot be stored."""


def store_path(run_dir: Path, phase: str = "train") -> Path:
    """Where a run directory keeps a phase's expert-load store (beside ``metrics.jsonl``):
    ``train`` (the training forwards) or ``rollout`` (what the rollout engine served)."""
    if phase not in PHASE_FILES:
        raise StoreError(f"phase must be one of {sorted(PHASE_FILES)}, got {phase!r}")
    return Path(run_dir) / PHASE_FILES[phase]


@dataclass(frozen=True)
class RecordHeader:
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
    def refusal(self) -> str | None:
        """Why this whole record is not read although its header holds (a size above
        :mod:`nemo_moe_metrics.config.limits`, a step above 2**53-1), or None: said, never decoded,
        so no table its header declares is ever allocated."""
        if self.step > MAX_STEP:
            return (
                f"a record names step {self.step:,}, above 2**53-1 (no run logs that many): it "
                "is skipped unread"
            )
        try:
            check_shape(self.layers, self.experts, f"step {self.step}", "it is skipped unread")
        except LimitError as err:
            return str(err)
        return None

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

    entries: list[RecordHeader]  # readable headers, in file order
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


def _parse_header(raw: bytes, offset: int) -> RecordHeader | None:
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
    return RecordHeader(step, offset, layers, experts, itemsize, codec, nbytes, crc, version, flags)


def _read_header(f: Any, offset: int) -> RecordHeader | None:
    f.seek(offset)
    return _parse_header(f.read(_HEADER_V2.size), offset)


def _verified(f: Any, e: RecordHeader, size: int) -> bool:
    """A candidate record found by searching is taken only when it is whole and checks out."""
    return e.end <= size and (e.version == 2 or _payload_ok(f, e))


def _payload_ok(f: Any, e: RecordHeader) -> bool:
    f.seek(e.offset)
    raw = f.read(e.header_size + e.payload_bytes)
    return _check(memoryview(raw), e)


def _check(view: memoryview, e: RecordHeader) -> bool:
    payload = view[e.header_size :]
    if len(payload) != e.payload_bytes:
        return False
    if e.version == 1:
        return zlib.crc32(payload, zlib.crc32(view[:28])) == e.crc
    return zlib.crc32(payload) == e.crc


def _search(f: Any, start: int, size: int) -> RecordHeader | None:
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


def scan_store(f: Any, size: int | None = None, name: str | Path | None = None) -> StoreScan:
    """Walk the record headers of an open store (payloads are skipped by seeking, not read)
    and say what is unreadable. Raises :class:`StoreError` when the file is not a store
    (naming ``name``, else the file's own name: a path, never a descriptor number)."""
    size = os.fstat(f.fileno()).st_size if size is None else size
    f.seek(0)
    head = f.read(len(MAGIC))
    if head != MAGIC:
        if MAGIC.startswith(head):  # empty, or the magic itself was torn
            return StoreScan([], len(head), torn_magic=bool(head))
        given = getattr(f, "name", None) if name is None else name
        shown = given if isinstance(given, str | Path) else "the file"
        raise StoreError(
            f"{shown} is not an expert-load store (it does not start with {MAGIC!r}); point "
            f"the reader at the {STORE_FILE} file of a run directory, or move this file aside"
        )
    scan = StoreScan([], len(MAGIC))
    offset = len(MAGIC)
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


def decode_record(
    f: Any, e: RecordHeader, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """``(layer_ids int64 [L], counts int64 [L, E], widths int64 [L] or None)`` of one record
    (widths None: every layer has all E experts); None if its CRC fails.

    ``f`` is a binary file or a file descriptor (read with ``os.pread``: several threads may
    decode from one descriptor); the counts go into ``out`` (int64 ``[L, E]``) when given.
    """
    if e.newer or e.refusal:
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
    if e.itemsize == 8:
        _check_counts(planes, e, layer_ids)
    counts = np.empty((e.layers, e.experts), dtype=np.int64) if out is None else out
    flat = counts.reshape(cells)
    # Undo the byte shuffle: count = sum of plane k << 8k (plane 0 holds the low bytes).
    # Shifting whole planes is about 3x faster than transposing the uint8 planes.
    np.copyto(flat, planes[-1])
    for k in range(e.itemsize - 2, -1, -1):
        flat <<= 8
        flat |= planes[k]
    if e.itemsize == 8 and counts.size:
        # Every count is below 2**53; so must a layer's step be, or its row sums could wrap.
        rows = counts.sum(axis=1, dtype=np.float64)
        if rows.max() >= COUNT_BOUND:
            row = int(np.argmax(rows))
            raise StoreCountError(
                f"step {e.step}: layer {int(layer_ids[row])}'s counts sum to {rows[row]:.4g} "
                "tokens, above 2**53-1 (no step routes that many): the record is skipped"
            )
    return layer_ids, counts, widths


class StoreCountError(StoreError):
    """A record whose checksums hold but which stores a count of 2**53 or more (the writer
    refuses them; a count of 2**64-1 would read back as -1): the reader skips it, naming
    the step, the layer and the expert."""


def _check_counts(planes: np.ndarray, e: RecordHeader, layer_ids: np.ndarray) -> None:
    """Raise :class:`StoreCountError` when a count of 8-byte planes is 2**53 or more (a bit
    above bit 52 set: plane 7, or plane 6's top three bits)."""
    bad = (planes[7] != 0) | (planes[6] >= 0x20)
    if not bad.any():
        return
    cell = int(np.argmax(bad))
    value = sum(int(planes[k, cell]) << (8 * k) for k in range(8))
    row, expert = divmod(cell, e.experts)
    raise StoreCountError(
        f"step {e.step}: layer {int(layer_ids[row])} expert {expert} holds a count of "
        f"{value:,}, above "
        "2**53-1 (no step routes that many tokens): the record is skipped"
    )


def encode_record(
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
