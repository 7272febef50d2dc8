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

from nemo_moe_metrics.sinks.base import Metrics, finite_or_none, is_table

METRICS_FILE = "metrics.jsonl"


#: The reserved field of a line that holds the step's alert records (moe/alerts.py).
ALERTS_FIELD = "alerts"


class JsonlSink:
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
            self.path.exists()
            and self.path.stat().st_size > 0
            and not _ends_with_newline(self.path)
        )
        self._file = self.path.open("a", encoding="utf-8")
        # Set when a write failed part-way (disk full): the next line starts on a fresh line so
        # the torn fragment cannot swallow it.
        self._torn = False
        if torn:
            self._file.write("\n")
            self._flush()

    def wants_tables(self, step: int) -> bool:
        """Never: tables go to the expert-load store."""
        return False

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
