"""JSON Lines sink: one object of scalars per step, flushed (and fsync'd) before ``log`` returns.

Tables (``moe/expert_loads``) are not written here: the expert-load store beside this file
keeps them compactly (:mod:`nemo_moe_metrics.sinks.store`).

The file survives any crash: every step whose ``log`` returned is on disk. A run that resumes
appends to the same file; if the previous process died in the middle of writing a line, a
newline is added first so the torn line stays on its own and readers can skip it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_moe_metrics.run_dir.names import METRICS_FILE as METRICS_FILE
from nemo_moe_metrics.sinks.base import Metrics, SinkBase, finite_or_none, is_table

#: The reserved field of a line that holds the step's alert records (sinks/alerts.py).
ALERTS_FIELD = "alerts"


class JsonlSink(SinkBase):
    """Append ``{"step": n, ...scalars}`` lines to ``path``; NaN/inf are written as ``null``.

    A step's alerts (from the alert monitor) follow its metrics in the same line, under the
    reserved field ``"alerts"``: a list of ``{"kind", "layer", "expert", "message"}``.
    """

    records_alerts = True  #: MultiSink hands this sink the step's alert records

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        torn = (
            self.path.is_file()
            and not self.path.is_symlink()
            and self.path.stat().st_size > 0
            and not _ends_with_newline(self.path)
        )
        # O_NOFOLLOW: a link in the run directory never sends the records elsewhere.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        # Set when a write failed part-way (disk full): the next line starts on a fresh line so
        # the torn fragment cannot swallow it.
        self._torn = False
        if torn:
            self._file.write("\n")
            self._flush()

    def wants_tables(self, step: int) -> bool:
        """Never: tables go to the expert-load store."""
        return False

    def location(self) -> str:
        """The JSONL file."""
        return str(self.path)

    def log(self, metrics: Metrics, step: int, alerts: Sequence[Mapping[str, Any]] = ()) -> None:
        """Write one line of scalars for ``step`` (then its ``alerts``, when there are any) and
        make it durable before returning."""
        record: dict[str, object] = {"step": int(step)}
        for key, value in metrics.items():
            if not is_table(key):
                record[key] = finite_or_none(value)
        if alerts:
            record[ALERTS_FIELD] = [dict(a) for a in alerts]
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        try:
            self._file.write("\n" + line if self._torn else line)
            self._flush()
        except OSError:
            self._torn = True
            raise
        self._torn = False

    def close(self) -> None:
        """Flush and close the file."""
        if not self._file.closed:
            self._flush()
            self._file.close()

    def _flush(self) -> None:
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def line_step(raw: bytes) -> int | None:
    """The step of one complete JSONL record, or None when the line is torn or not a record."""
    try:
        record = json.loads(raw)
        step = record["step"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    return step


def read_tail(path: Path, enough: int) -> tuple[list[tuple[int, int]], int]:
    """The last complete records of ``path`` as ``(byte offset, step)``, last first, read from
    the end until ``enough`` records were found (or the file's start); and where the file's
    readable part ends (before a torn last line: a crash mid-write)."""
    with Path(path).open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        chunk = 1 << 16
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            data = f.read(size - start)
            found, end = _tail_records(data, start, enough)
            if len(found) >= enough or start == 0:
                return found, end
            chunk *= 4


def _tail_records(data: bytes, start: int, enough: int) -> tuple[list[tuple[int, int]], int]:
    lines: list[tuple[int, bytes]] = []
    pos = start
    for piece in data.split(b"\n"):
        lines.append((pos, piece))
        pos += len(piece) + 1
    if start > 0:
        lines = lines[1:]  # the first piece may be the end of a line that began earlier
    found: list[tuple[int, int]] = []
    end = start + len(data)
    trailing = True  # unparseable lines at the very end are torn writes, cut by a resume
    for offset, raw in reversed(lines):
        if not raw.strip():
            continue
        step = line_step(raw)
        if step is None:
            if trailing and not _is_json(raw):
                end = offset
            else:
                trailing = False  # a whole line that is no record (a note): kept, never cut
            continue
        trailing = False
        found.append((offset, step))
        if len(found) >= enough:
            break
    return found, end


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def cut_after(path: Path, offset: int) -> int:
    """Truncate ``path`` to ``offset`` bytes (durably); returns how many bytes went."""
    with os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if offset >= size:
            return 0
        f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())
    return size - offset
