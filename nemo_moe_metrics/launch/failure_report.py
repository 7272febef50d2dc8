"""What a failed local run prints: the failing rank (:mod:`nemo_moe_metrics.launch.failures`), the
ranks' last words when torchrun itself died, a full disk, and where the logs are."""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from nemo_moe_metrics.launch.failures import (
    launcher_death_lines,
    rank_failure_lines,
    read_failures,
    torchelastic_last_words,
)
from nemo_moe_metrics.run_dir.names import LAUNCH_LOG, NEMORUN_DIR


def failure_report(
    run_dir: Path,
    returncode: int,
    since: float = 0.0,
    last_words: Path | None = None,
    stopped: list[str] | None = None,
) -> str:
    """What a failed run prints: the failing rank's first error, then where the logs are.

    The rank that failed first is named (:mod:`.failures`): a rank killed by a signal (out of
    memory, ``kill -9``) as such, and the errors it caused on the other ranks ("Connection
    closed by peer") after it, as consequences. ``last_words`` is the file the ranks recorded
    their errors in (outside the run directory: it survives a full disk).
    """
    lines = [f"run failed (exit {returncode})", *(stopped or [])]
    log = latest_rank_log(run_dir, since)
    launch_log = run_dir / LAUNCH_LOG
    full = _disk_full_note(run_dir)
    said = rank_failure_lines(log, read_failures(last_words))
    orphaned = launcher_death_lines(torchelastic_last_words(run_dir / NEMORUN_DIR, since))
    if orphaned:  # torchrun died first: a rank's error after it (a lost peer) is its consequence
        lines += orphaned
        if said and not said[0].startswith("no Python exception"):
            lines.append(f"  then, because of it: {said[0].splitlines()[0]}")
    elif said and not said[0].startswith("no Python exception"):
        lines += said
    elif log and _ranks_finished(log):
        lines.append(_launcher_failed(run_dir, log, launch_log))
    elif full:
        lines.append(full)  # the ranks' own errors may be what could not be written
        full = None
    elif log:
        lines += said + [f"  {line}" for line in _tail(log, 10)]
    elif launch_log.is_file():
        # The launcher itself failed (no rank started): its last lines say why.
        lines += [f"  {line}" for line in _tail(launch_log, 10)]
    if full:
        lines.append(full)
    if log:
        lines.append(f"rank log: {log}")
        hint = status_hint(run_dir, log)
        if hint:
            lines.append(f"job status: {hint}")
    lines.append(f"launcher log: {launch_log}")
    return "\n".join(lines)


def _ranks_finished(log: Path) -> bool:
    """Whether torchrun's log says every rank ended well (then the launcher failed after)."""
    return any("WorkerState.SUCCEEDED" in line for line in _tail(log, 40))


def _launcher_failed(run_dir: Path, log: Path, launch_log: Path) -> str:
    """Every rank finished, then nemo-run failed: the error its log names, and where."""
    found = re.findall(r"\[Errno (\d+)\]", "\n".join(_tail(launch_log, 200)))
    code = int(found[-1]) if found else 0
    why = f": {os.strerror(code)} ({errno.errorcode.get(code, '?')})" if code else ""
    return (
        f"no rank failed: every rank finished its steps ({log} says the worker group "
        f"succeeded); then the launcher (nemo-run) failed writing its job state in "
        f"{run_dir / NEMORUN_DIR} or {launch_log}{why}"
    )


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError as err:
        return [f"(cannot read {path}: {err.strerror or err})"]


def _disk_full_note(run_dir: Path, below: int = 1 << 20) -> str | None:
    """A line when the run directory's file system is (nearly) full: then the ranks' own
    error may be missing from their log, which could not be written either."""
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= below:
        return None
    return (
        f"the run directory's file system is full ({free:,} bytes free at {run_dir}): writes "
        "failed there (logs may be cut short). Free space or choose another --output-dir, "
        "then continue with --resume"
    )


def latest_rank_log(run_dir: Path, since: float = 0.0) -> Path | None:
    logs = [p for p in (run_dir / NEMORUN_DIR).rglob("combined.log") if p.stat().st_mtime >= since]
    return max(logs, key=os.path.getmtime) if logs else None


def status_hint(run_dir: Path, log: Path) -> str | None:
    """``NEMORUN_HOME=... nemo experiment status ID``: works as printed (checked)."""
    home = run_dir / NEMORUN_DIR
    parts = log.relative_to(home / "experiments").parts if home in log.parents else ()
    if len(parts) < 2 or not shutil.which("nemo", path=str(Path(sys.executable).parent)):
        return None
    nemo = Path(sys.executable).parent / "nemo"
    return (
        f"NEMORUN_HOME={shlex.quote(str(home))} {shlex.quote(str(nemo))} "
        f"experiment status {parts[1]}"
    )
