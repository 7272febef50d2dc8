"""What a resumed run continues from: the run directory's last logged step and running totals.

``logger.resume: true`` means: the run in the output directory goes on. Its next step is the
last step in ``metrics.jsonl`` plus one; ``train_perf/total_tokens``, ``total_seconds`` and the
FLOP total (``cumulative_estimated_flops_per_second x total_seconds``) start from that step's
values, so cumulative rates continue; JSONL and the expert-load store append; TensorBoard hides
events an earlier process wrote at or after the next step; W&B continues the run id kept in
``run.json``. Model weights and optimizer state are not part of it: a training loop that
checkpoints restores them itself (and passes the restored step).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_moe_metrics import metric_names as mn
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE


@dataclass(frozen=True)
class ResumeState:
    """Where a resumed run picks up; ``last_step`` is None when nothing was logged yet."""

    last_step: int | None = None
    total_tokens: float = 0.0
    total_seconds: float = 0.0
    total_flops: float = 0.0

    @property
    def next_step(self) -> int:
        """The first step the resumed run trains and logs."""
        return 0 if self.last_step is None else self.last_step + 1


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete, parseable JSON line of ``path`` (read from the end), or None.

    A torn last line (crash mid-write) is passed over; only the tail of the file is read.
    """
    path = Path(path)
    if not path.is_file():
        return None
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        chunk = 1 << 16
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
            # When not at the file start, the first piece may be the tail of a longer line.
            candidates = lines if start == 0 else lines[1:]
            for raw in reversed(candidates):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                    int(record["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # torn or foreign line
                if isinstance(record, dict):
                    return record
            if start == 0:
                return None
            chunk *= 4


def read_resume_state(run_dir: Path) -> ResumeState:
    """The state ``run_dir``'s ``metrics.jsonl`` ends in; a fresh state if there is none."""
    record = last_record(Path(run_dir) / METRICS_FILE)
    if record is None:
        return ResumeState()
    tokens = _number(record.get(mn.TOTAL_TOKENS))
    seconds = _number(record.get(mn.TOTAL_SECONDS))
    flops_rate = _number(record.get(mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND))
    return ResumeState(
        last_step=int(record["step"]),
        total_tokens=tokens,
        total_seconds=seconds,
        total_flops=flops_rate * seconds,
    )


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value)
