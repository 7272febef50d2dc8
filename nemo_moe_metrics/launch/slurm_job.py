"""Slurm's side of a submitted job: its state in plain words, the rank environment of one Slurm
task per rank, a requeued job continuing its run, and following a job to its end.

Slurm has two views of a job. ``scontrol show job`` (the controller; no database needed) knows a
job while it pends or runs and for ``MinJobAge`` seconds after it ends (300 by default).
``sacct`` (the accounting database) knows it as long as the site keeps records, but only where
slurmdbd is configured; without it sacct answers "Slurm accounting storage is disabled".
:func:`query_job` asks scontrol first and sacct second, and both give the same ``ExitCode``
(``code:signal``) that :func:`explain` turns into a sentence.

The job submission itself (nemo-run's ``SlurmExecutor``) is in :mod:`.slurm_submit`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from nemo_moe_metrics.launch.failures import first_rank_failure
from nemo_moe_metrics.launch.progress import describe_step, read_new_lines
from nemo_moe_metrics.report import render_report
from nemo_moe_metrics.run_dir.record import logged_run
from nemo_moe_metrics.run_dir.resume import read_resume_state

SUBMITTED_DIR = "submitted"  # <job dir>/submitted/<job id>.json: what --follow reads
UNREACHABLE_S = 300  # how long follow_job keeps asking a controller that does not answer

# States after which the job will not run again (a requeued job goes back to PENDING instead).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)

_STATE_MEANING = {
    "COMPLETED": "every rank finished",
    "FAILED": "the job's command failed",
    "CANCELLED": "cancelled (scancel, or an administrator)",
    "TIMEOUT": "reached its time limit{limit}; ask for more with --time",
    "PREEMPTED": "preempted by a higher-priority job",
    "NODE_FAIL": "one of its nodes failed (hardware or slurmd)",
    "OUT_OF_MEMORY": "ran out of host memory on a node (sbatch --mem asks for more)",
    "BOOT_FAIL": "its nodes failed to boot",
    "DEADLINE": "reached its deadline before finishing",
    "REVOKED": "revoked (a federated sibling job started elsewhere)",
    "SPECIAL_EXIT": "held after a special exit code",
}


# Reasons the state and exit code already say.
_OBVIOUS_REASONS = frozenset({"JobLaunchFailure", "NonZeroExitCode", "TimeLimit", "None"})


class SlurmError(RuntimeError):
    """sbatch, scontrol or sacct failed; the message carries Slurm's own words."""


@dataclass(frozen=True)
class JobInfo:
    """One job as Slurm reports it."""

    job_id: str
    state: str  # first word of JobState/State: PENDING, RUNNING, COMPLETED, CANCELLED, ...
    exit_code: int = 0  # the batch script's exit status (ExitCode before the colon)
    signal: int = 0  # the signal that ended it (ExitCode after the colon), 0 if none
    reason: str | None = None  # why it pends or failed (None when Slurm says "None")
    nodes: str | None = None
    time_limit: str | None = None
    restarts: int = 0
    source: str = "scontrol"  # or "sacct"

    @property
    def terminal(self) -> bool:
        """True once the job will not run again."""
        return self.state in TERMINAL_STATES


_SCONTROL_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s[A-Za-z][\w/:]*=|$)")


def parse_scontrol_job(text: str) -> dict[str, str]:
    """``Key=Value`` fields of ``scontrol show job -o`` (one line; values may hold spaces)."""
    return {m[1]: m[2] for m in _SCONTROL_FIELD.finditer(text.strip())}


def _exit(text: str | None) -> tuple[int, int]:
    code, _, sig = (text or "0:0").partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return 0, 0


def _none(value: str | None) -> str | None:
    return None if value in (None, "", "None", "(null)") else value


def job_info_from_scontrol(text: str) -> JobInfo | None:
    """A :class:`JobInfo` from ``scontrol show job -o ID`` output (None if it names no job)."""
    fields = parse_scontrol_job(text)
    if "JobId" not in fields or "JobState" not in fields:
        return None
    code, sig = _exit(fields.get("ExitCode"))
    return JobInfo(
        job_id=fields["JobId"],
        state=fields["JobState"].split()[0],
        exit_code=code,
        signal=sig,
        reason=_none(fields.get("Reason")),
        nodes=_none(fields.get("NodeList")),
        time_limit=_none(fields.get("TimeLimit")),
        restarts=int(fields.get("Restarts", "0") or 0),
    )


SACCT_FIELDS = "JobID,State,ExitCode,Reason,NodeList,Timelimit"


def job_info_from_sacct(text: str, job_id: str) -> JobInfo | None:
    """A :class:`JobInfo` from ``sacct -X -n -P -o SACCT_FIELDS -j ID`` (None if absent)."""
    rows = [line.split("|") for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if len(r) >= 6 and r[0] == str(job_id)]
    if not rows:
        return None
    jid, state, exit_code, reason, nodes, limit = rows[-1][:6]
    code, sig = _exit(exit_code)
    return JobInfo(
        job_id=jid,
        state=state.split()[0],  # "CANCELLED by 0"
        exit_code=code,
        signal=sig,
        reason=_none(reason),
        nodes=_none(nodes),
        time_limit=_none(limit),
        source="sacct",
    )


Runner = Callable[..., subprocess.CompletedProcess]


def query_job(job_id: str, run: Runner = subprocess.run) -> JobInfo | None:
    """The job's state from scontrol, else from sacct; None when neither knows it.

    scontrol forgets a job ``MinJobAge`` seconds after it ends; sacct remembers it only where
    accounting (slurmdbd) is configured. SlurmError when the controller cannot be asked.
    """
    kwargs: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60}
    proc = run(["scontrol", "show", "job", "-o", str(job_id)], **kwargs)
    if proc.returncode == 0:
        info = job_info_from_scontrol(proc.stdout)
        if info is not None:
            return info
    elif "Invalid job id" not in proc.stderr:
        said = (proc.stderr or proc.stdout).strip()
        raise SlurmError(f"scontrol show job {job_id} failed: {said}")
    proc = run(["sacct", "-X", "-n", "-P", "-o", SACCT_FIELDS, "-j", str(job_id)], **kwargs)
    if proc.returncode == 0:
        return job_info_from_sacct(proc.stdout, str(job_id))
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def explain(info: JobInfo) -> str:
    """One line: the state, the exit code as Slurm prints it, and what they mean."""
    limit = f" ({info.time_limit})" if info.time_limit else ""
    meaning = _STATE_MEANING.get(info.state, info.state.lower()).format(limit=limit)
    head = f"{info.state}, ExitCode {info.exit_code}:{info.signal}: {meaning}"
    code, sig = info.exit_code, info.signal
    if info.state == "COMPLETED":
        return head
    detail = None
    if info.reason == "JobLaunchFailure" or (code == 0 and sig == 53):
        detail = (
            "Slurm could not start the batch script, usually because its output file could not "
            "be opened: the job directory (--job-dir) must be on a filesystem the compute "
            "nodes share"
        )
    elif code == 127:
        detail = (
            "a command was not found on the node (python or torchrun): submit from the "
            "environment the job should use (sbatch exports it) or give --container-image"
        )
    elif code == 126:
        detail = "a command in the job could not be executed (permissions)"
    elif code == 2:
        detail = "a rank refused the recipe (configuration error, exit 2): see the rank error"
    elif code > 128:
        detail = f"a process was ended by {_signal_name(code - 128)} (exit {code})"
        if code - 128 in (signal.SIGTERM, signal.SIGKILL):
            # srun --kill-on-bad-exit (and torchrun) stop every rank once one fails.
            detail += (
                ": when one rank fails the others are stopped, so the cause is usually the "
                "first rank error below"
            )
            if code - 128 == signal.SIGKILL:
                detail += " (otherwise: out of memory)"
    elif code:
        detail = f"a rank exited {code}: see the rank error below"
    if sig and sig != 53:
        killed = f"ended by {_signal_name(sig)}"
        if sig == signal.SIGKILL:
            killed += " (memory limit, or the kill after the time limit's grace period)"
        detail = f"{detail}; {killed}" if detail else killed
    if info.reason and info.reason not in _OBVIOUS_REASONS and info.state != "CANCELLED":
        detail = f"{detail} (reason: {info.reason})" if detail else f"reason: {info.reason}"
    return f"{head}; {detail}" if detail else head


def rank_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` for a process ``srun`` started as one task per rank.

    Empty when a launcher (torchrun) already set ``RANK``, or outside an ``srun`` step: a batch
    script's own environment has ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` but is no
    step (no ``SLURM_STEP_ID``), and must not believe it is rank 0 of several. The rendezvous
    address comes from ``MASTER_ADDR`` and ``MASTER_PORT``, which ``recipes/slurm.py
    --launcher srun`` exports (the first node's address); without them a step of several tasks
    is refused with :class:`SlurmError` instead of each task training alone.
    """
    if "RANK" in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return {}
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
    }
    if int(world) > 1 and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        raise SlurmError(
            f"srun started {world} tasks (SLURM_PROCID {environ['SLURM_PROCID']}) but "
            "MASTER_ADDR and MASTER_PORT are not set, so the ranks cannot meet: export "
            "MASTER_ADDR=<first node's address> and MASTER_PORT=<free port> before srun, or "
            "submit with recipes/slurm.py --launcher srun (it exports both)"
        )
    return env


def requeue_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 for a first start)."""
    try:
        return int(environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


@dataclass
class SubmittedJob:
    """What ``recipes/slurm.py --submit`` records, so ``--follow JOB_ID`` can find the job later."""

    job_id: str
    name: str  # the recipe's name: the Slurm job name and the run directory's name
    run_dir: str
    job_files: str  # nemo-run's folder for this job: sbatch and rank logs, packaged code
    max_steps: int
    jsonl_offset: int = 0  # metrics.jsonl size at submit: later lines are this job's
    nodes: int = 1
    ranks_per_node: int = 1
    launcher: str = "torchrun"
    algorithm: str | None = None  # grpo: the progress lines show the reward first
    notes: list[str] = field(default_factory=list)  # what the submitter should know

    def save(self, job_dir: Path) -> Path:
        """Write ``<job_dir>/submitted/<job_id>.json``."""
        path = Path(job_dir) / SUBMITTED_DIR / f"{self.job_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, job_dir: str | Path, job_id: str) -> SubmittedJob:
        """Read the record ``save`` wrote; SlurmError naming the directory when there is none."""
        path = Path(job_dir) / SUBMITTED_DIR / f"{job_id}.json"
        if not path.is_file():
            known = sorted(p.stem for p in path.parent.glob("*.json"))
            raise SlurmError(
                f"no job {job_id} was submitted with --job-dir {job_dir} ({path} not found); "
                + (f"jobs recorded there: {', '.join(known)}" if known else "none recorded there")
            )
        return cls(**json.loads(path.read_text()))

    def rank_log(self) -> Path | None:
        """The newest srun output of this job (one file per Slurm restart)."""
        logs = list(Path(self.job_files).glob(f"log-*_{self.job_id}_*.out"))
        return max(logs, key=os.path.getmtime) if logs else None

    def batch_log(self) -> Path:
        """The batch script's own output (``set -x`` trace, ``job exited with code N``)."""
        return Path(self.job_files) / f"sbatch_{self.name}_{self.job_id}.out"


def follow_job(
    job: SubmittedJob,
    out: TextIO | None = None,
    poll_s: float = 2.0,
    query: Callable[[str], JobInfo | None] = query_job,
    report: bool = True,
) -> int:
    """Print the job's state changes and logged steps until it ends; 0 if it COMPLETED, else 1.

    At the end: the state and exit code in words (:func:`explain`); on success the run's report
    (as ``nemo-moe-metrics run`` prints it, with ``report``); otherwise the first rank error from
    the rank log, how to continue the run (``--resume``) when it logged steps, and the logs.
    """
    out = out or sys.stdout
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    run_dir = Path(job.run_dir)
    metrics = run_dir / "metrics.jsonl"
    offset, last_row, seen, info, unreachable_since = job.jsonl_offset, None, None, None, None

    def show_new_steps() -> None:
        nonlocal offset, last_row
        rows, offset = read_new_lines(metrics, offset)
        for row in rows:
            last_row = row
            text = describe_step(row, job.algorithm)
            say(f"step {row['step'] + 1}/{job.max_steps}  {text}".rstrip())

    while True:
        try:
            info = query(job.job_id)
        except SlurmError as err:  # the controller restarts, the network hiccups: ask again
            if unreachable_since is None:
                unreachable_since = time.monotonic()
                say(f"{err}; asking again every {poll_s:g} s for {UNREACHABLE_S // 60} minutes")
            elif time.monotonic() - unreachable_since > UNREACHABLE_S:
                raise
            time.sleep(poll_s)
            continue
        unreachable_since = None
        show_new_steps()
        shown = None if info is None else (info.state, info.reason, info.nodes, info.restarts)
        if info is not None and shown != seen:
            where = f" on {info.nodes}" if info.nodes and info.state == "RUNNING" else ""
            why = f" ({info.reason})" if info.reason and info.state == "PENDING" else ""
            again = f", restart {info.restarts}" if info.restarts else ""
            if not info.terminal:
                say(f"job {job.job_id} ({job.name}): {info.state}{where}{why}{again}")
            seen = shown
        if info is None or info.terminal:
            break
        time.sleep(poll_s)
    show_new_steps()
    if info is None:
        say(
            f"job {job.job_id} ({job.name}): Slurm no longer knows it (scontrol forgets a job "
            "MinJobAge seconds after it ends; sacct needs accounting, slurmdbd)"
        )
        exit_line = _batch_exit_line(job.batch_log())
        if exit_line:
            say(f"its batch log says: {exit_line}")
    else:
        say(f"job {job.job_id} ({job.name}): {explain(info)}")
    if info is not None and info.state == "COMPLETED":
        last = last_row["step"] if last_row else read_resume_state(run_dir).last_step
        say(f"done: {run_dir}  (last step {last})")
        if report and metrics.is_file():
            say(render_report(run_dir))
        return 0
    log = job.rank_log()
    failure = first_rank_failure(log) if log else None
    if failure:
        say(failure.describe())
    if logged_run(run_dir):
        last = read_resume_state(run_dir).last_step
        say(
            f"{run_dir} keeps the steps up to {last} (of training.max_steps={job.max_steps}): "
            "continue the run with the same recipes/slurm.py command plus --resume"
        )
    if log:
        say(f"rank log: {log}")
    say(f"batch log: {job.batch_log()}")
    return 1


def _batch_exit_line(path: Path) -> str | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [line for line in lines if line.startswith("job exited with code")]
    return hits[-1] if hits else None
