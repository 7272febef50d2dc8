"""Writing the expert-load store: :class:`ExpertLoadStore` appends one durable record per
step (and cuts a record torn by a crash when it opens a store), :func:`cut_store_from` drops
the last steps before a resumed run logs them again, and :class:`ExpertLoadSink` turns each
logged ``moe/expert_loads`` table into a record. The format is in
:mod:`nemo_moe_metrics.sinks.store_format`."""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import (
    COUNT_BOUND,
    MAX_STEP,
    LimitError,
    check_shape,
    first_over,
)
from nemo_moe_metrics.export.expert_table import ExpertTable
from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
from nemo_moe_metrics.sinks.base import Metrics, SinkBase
from nemo_moe_metrics.sinks.store_format import (
    MAGIC,
    RecordHeader,
    StoreCountError,
    StoreError,
    StoreScan,
    decode_record,
    encode_record,
    scan_store,
)


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
        try:
            # O_NOFOLLOW: a store is appended to, so a link in its place would change its target.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise StoreError(
                f"{self.path} is a symbolic link: the store is never written through one; "
                "remove the link (rm leaves its target alone)"
            ) from None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                size = os.fstat(fd).st_size
                scan = scan_store(f, size, name=self.path)
                end = _cut_point(f, scan, size)
            for gap in scan.gaps:
                if gap.before_step is not None:
                    warnings.warn(f"{self.path}: {gap.describe()}", RuntimeWarning, stacklevel=2)
            if end < len(MAGIC):
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
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
        if step > MAX_STEP:
            raise StoreError(f"step {step:,} is above 2**53-1 (no run logs that many steps)")
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
        bad = first_over(arr)
        if bad is not None:
            row, expert = bad
            raise StoreError(
                f"step {step}: layer {int(ids[row])} expert {expert} has a count of "
                f"{int(arr[row, expert]):,}, above 2**53-1 (no step routes that many tokens; "
                "larger counts would not read back exactly)"
            )
        rows = arr.sum(axis=1, dtype=np.float64) if arr.size else np.zeros(0)
        if rows.size and rows.max() >= COUNT_BOUND:
            row = int(np.argmax(rows))
            raise StoreError(
                f"step {step}: layer {int(ids[row])}'s counts sum to {rows[row]:.4g} tokens, "
                "above 2**53-1 (no step routes that many; sums of them would not stay exact)"
            )
        try:
            check_shape(*arr.shape, f"step {step}", "store fewer layers or experts per step")
        except LimitError as err:
            raise StoreError(str(err)) from None
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise StoreError(f"layer ids must be in 0..2**31-1, got {ids.tolist()}")
        record = encode_record(int(step), ids, arr, _checked_widths(widths, arr))
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
    if scan.torn_magic or size < len(MAGIC):
        return 0
    end = scan.tail.start if scan.tail is not None else size
    entries = list(scan.entries)
    while (
        entries
        and entries[-1].end == end
        and not entries[-1].newer
        and not entries[-1].refusal  # whole, only above this reader's limits: kept
        and _fails(f, entries[-1])
    ):
        end = entries.pop().offset
    return max(end, len(MAGIC))


def _fails(f: Any, e: RecordHeader) -> bool:
    """Whether a record fails its checksum or inflation (a count above the bound is whole)."""
    try:
        return decode_record(f, e) is None
    except StoreCountError:
        return False


def cut_store_from(path: Path, step: int) -> list[int]:
    """Cut the records at the end of the store whose step is ``>= step`` (a resumed run logs
    them again); returns their steps. Records before a lower step stay (readers keep the
    latest timeline), and so does a record cut short (the next writer cuts it)."""
    with open(path, "r+b") as f:
        scan = scan_store(f, name=path)
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


class ExpertLoadSink(SinkBase):
    """A sink that writes each ``table_every``-th step's ``moe/expert_loads`` to the store."""

    def __init__(self, path: Path, *, table_every: int = 1, fsync: bool = True) -> None:
        if isinstance(table_every, bool) or not isinstance(table_every, int) or table_every < 1:
            raise ValueError(f"table_every must be an int >= 1, got {table_every!r}")
        self.table_every = table_every
        self.store = ExpertLoadStore(path, fsync=fsync)

    def wants_tables(self, step: int) -> bool:
        """Whether ``step`` is on the table cadence."""
        return step % self.table_every == 0

    def location(self) -> str:
        """The store file."""
        return str(self.store.path)

    def log(self, metrics: Metrics, step: int) -> None:
        """Append the step's counts when it has a table and ``step`` is on the cadence."""
        table = metrics.get(EXPERT_LOADS)
        if table is None or step % self.table_every:
            return
        self.log_table(table, step)

    def log_table(self, table: Any, step: int) -> None:
        """Append ``step``'s table whatever the cadence (a run's last step, at its close)."""
        if isinstance(table, ExpertTable):  # the arrays themselves: no rows
            self.store.append(step, table.layer_ids, table.counts, table.widths)
        else:
            self.store.append(step, *table_to_counts_and_widths(table))

    def close(self) -> None:
        """Close the store file."""
        self.store.close()
