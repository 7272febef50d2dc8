"""What a resumed run continues from: the run directory's last logged step and running totals.

``logger.resume: true`` means: the run in the output directory goes on. Its next step is the
last step in ``metrics.jsonl`` plus one; ``train_perf/total_tokens``, ``total_seconds`` and the
FLOP total (``cumulative_estimated_flops_per_second x total_seconds``) start from that step's
values, so cumulative rates continue; JSONL and the expert-load store append; TensorBoard hides
events an earlier process wrote at or after the next step; W&B continues the run id kept in
``run.json``. Model weights and optimizer state are not part of it: a training loop that
checkpoints restores them itself (and passes the restored step).

Before a resumed run appends, :func:`prepare_resume` makes the local records agree: a step is
complete when its ``metrics.jsonl`` line is (the sinks write the JSONL last), so a store record
past the JSONL's last step is cut and logged again; a JSONL step on the table cadence whose
store record is missing at the end (a run from before that order, or a record lost) is cut
from the JSONL and logged again; a torn last line is cut. Each of these is said in a note.
A run whose ``metrics.jsonl`` is gone or empty while other records hold steps is refused
(:class:`ResumeError`): the step to continue from is unknown.

A training loop that restored a checkpoint older than the last logged step passes that step
(``resume_after``, e.g. a Trainer's restored ``global_step``): the records of later steps are
cut too, so the steps trained again are logged once and the totals continue from the
checkpoint's step (TensorBoard hides the later events through the resumed run's next step).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, cut_after, read_tail
from nemo_moe_metrics.sinks.store import StoreError, cut_store_from, scan_store, store_path
from nemo_moe_metrics.sinks.tensorboard import logged_steps


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


class ResumeError(ValueError):
    """The run directory cannot be continued as it is; the message says why and what to do."""


def prepare_resume(
    run_dir: Path, *, table_every: int = 1, resume_after: int | None = None
) -> tuple[ResumeState, list[str]]:
    """Make ``run_dir``'s ``metrics.jsonl`` and expert-load store agree, then read the state
    to continue from; returns it and notes saying what was cut and why (see the module doc).

    ``table_every`` is the run's ``logger.table_every``: a JSONL step on that cadence after the
    store's last record has lost its counts. ``resume_after``: the step the training itself
    continues after (a checkpoint's step, e.g. a Trainer's ``global_step`` restored by
    ``resume_from_checkpoint``); records of later steps are cut, so the steps trained again are
    each logged once and the totals continue from that step's. Raises :class:`ResumeError` when the
    directory cannot be continued (no step in ``metrics.jsonl`` while the store or TensorBoard hold
    some, or an ``expert_loads.bin`` that is not a store).
    """
    run_dir = Path(run_dir)
    jsonl, store = run_dir / METRICS_FILE, store_path(run_dir)
    try:
        scan = _scan(store, scan_store)
    except StoreError as err:
        raise ResumeError(
            f"--resume: {err}. Move it aside to continue without the earlier counts "
            f"(mv {store} {store}.bad), or start afresh with --overwrite"
        ) from None
    stored = scan.entries if scan is not None else []
    notes: list[str] = []
    tail, end = read_tail(jsonl, 2) if jsonl.is_file() else ([], 0)
    if not tail:
        _refuse_without_jsonl(run_dir, stored)
        return ResumeState(), notes
    if jsonl.stat().st_size > end:
        cut = cut_after(jsonl, end)
        notes.append(f"{jsonl}: cut a torn last line ({cut} bytes, written as a crash hit)")
    last = tail[0][1]
    if len(tail) > 1 and tail[1][1] >= last:
        notes.append(
            f"{jsonl}: its last line logs step {last} after step {tail[1][1]}: the steps after "
            f"{last} logged before it are superseded (a restart from an earlier step, or a "
            f"line added by hand); the run continues after step {last}"
        )
    resume_at = last + 1
    if stored and stored[-1].step < last:
        first_missing = (stored[-1].step // table_every + 1) * table_every
        if first_missing <= last:
            resume_at = first_missing
    if resume_at <= last:
        notes.append(
            f"{jsonl}: step(s) {resume_at}–{last} have no record in {store.name} (the run "
            f"ended between writing the two): cut, and logged again from step {resume_at}"
        )
    if resume_after is not None and resume_after + 1 < resume_at:
        resume_at = max(0, resume_after + 1)
        if resume_at <= last:
            notes.append(
                f"{jsonl}: training continues after step {resume_after} (its checkpoint): the "
                f"records of steps {resume_at}–{last} are cut and those steps logged again"
            )
    if resume_at <= last:
        cut_after(jsonl, _end_of_last_line_below(jsonl, resume_at))
    _refuse_lost_totals(jsonl)  # before anything in the store is cut
    if stored:
        cut = cut_store_from(store, resume_at)
        if cut:
            notes.append(
                f"{store}: step(s) {_span(cut)} stored after the last complete step of "
                f"{jsonl.name} (the run ended between writing the two, or training continues "
                "from an earlier checkpoint): cut, and logged again"
            )
    return read_resume_state(run_dir), notes


#: The running totals a resumed run continues from (``train_perf/``): each must be a finite
#: number in the last line when it is there at all (the FLOP rate may be null: no estimate).
RUNNING_TOTALS = (mn.TOTAL_TOKENS, mn.TOTAL_SECONDS)


def _refuse_lost_totals(jsonl: Path) -> None:
    """A last line whose running total is null or not a number would restart it from 0."""
    record = last_record(jsonl) or {}
    for key in RUNNING_TOTALS:
        value = record.get(key, 0.0)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ResumeError(
                f"--resume: the last line of {jsonl} (step {record.get('step')}) holds {key} = "
                f"{json.dumps(value)}, not a finite number, so the running totals cannot go on "
                "from it (they would silently restart from 0). Remove that line to continue "
                "after the step before it, or start afresh with --overwrite"
            )


def _scan(store: Path, scan_store: Any) -> Any:
    if not store.is_file():
        return None
    with store.open("rb") as f:
        return scan_store(f)


def _end_of_last_line_below(path: Path, step: int) -> int:
    """Where the last record with a step below ``step`` ends (0: there is none)."""
    wanted = 8
    while True:
        lines, _ = read_tail(path, wanted)
        offset = next((off for off, s in lines if s < step), None)
        if offset is not None:
            with path.open("rb") as f:
                f.seek(offset)
                return offset + len(f.readline())
        if len(lines) < wanted:
            return 0
        wanted *= 4


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"


def _refuse_without_jsonl(run_dir: Path, stored: list[Any]) -> None:
    """No complete line in ``metrics.jsonl``: fine for a run that logged nothing anywhere."""
    held = []
    if stored:
        held.append(f"expert_loads.bin (steps {stored[0].step}–{stored[-1].step})")
    tb = Path(run_dir) / "tensorboard"
    if tb.is_dir() and logged_steps(tb):
        held.append("tensorboard/ (scalar events)")
    if held:
        jsonl = Path(run_dir) / METRICS_FILE
        state = "is empty" if jsonl.is_file() else "is missing"
        raise ResumeError(
            f"--resume: {jsonl} {state}, but logged steps remain in {' and '.join(held)}: the "
            "step to continue from is unknown (a resume continues after the last line of "
            f"{METRICS_FILE}: keep logger.jsonl_enabled on for runs you may resume), and starting "
            "at step 0 would write over them. "
            f"Restore {METRICS_FILE} (from a backup), or start afresh with --overwrite"
        )


# W&B names its run folders wandb/[offline-]run-<YYYYmmdd_HHMMSS>-<run id>.
_WANDB_RUN = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-([A-Za-z0-9]+)$")


def recover_run_id(run_dir: Path) -> tuple[str | None, str]:
    """The run id of a run whose ``run.json`` is gone: from its newest W&B run folder.

    Returns ``(run id or None, a note saying what happened and what it means)``.
    """
    folders = sorted(
        (p for p in (Path(run_dir) / "wandb").glob("*run-*") if _WANDB_RUN.match(p.name)),
        key=lambda p: p.name.split("-")[-2],
    )
    if folders:
        run_id = _WANDB_RUN.match(folders[-1].name)[1]  # type: ignore[index]
        return run_id, (
            f"{run_dir}/run.json is missing or unreadable; the run id {run_id} was recovered "
            f"from {folders[-1].relative_to(run_dir)}, so W&B continues that run (MLflow, if "
            "on, starts a new run: its id was kept only in run.json)"
        )
    return None, (
        f"{run_dir}/run.json is missing or unreadable, and no W&B run folder names the earlier "
        "run id: W&B and MLflow (if on) start new runs; metrics.jsonl, the store and "
        "TensorBoard continue as usual. Restore run.json to continue the same W&B run"
    )
