"""One run per directory, the one owner of that policy: what a run directory's record is
(:func:`logged_run`), when a new run is refused (:func:`refuse_logged_run`, used by every
writer: ``build_sinks``, rank 0 of a job, the launchers), and what may be deleted
(:func:`clear_run`: a run's own entries by name, never through a link).

For launchers: every launcher (``nemo-moe-metrics run``, the Slurm submission) calls
:func:`prepare_run_dir` holding the directory's lock
(:class:`~nemo_moe_metrics.run_dir.RunDirLock`), after :func:`check_before_lock` (said before the
lock file is created). The rules:

- The directory holds only a run's own entries (:mod:`nemo_moe_metrics.run_dir.names`); anything
  else (a user's ``notes.txt``) makes it not a run directory: refused naming the entries, nothing
  deleted (``--resume`` keeps everything and is allowed).
- No entry of the run is a symbolic link: a run never writes or deletes through one.
- A run that logged steps is refused unless ``--resume`` (continue it) or ``--overwrite``
  (delete its entries first).
- A run that failed before logging a step is cleared, and said, when something proves it was a
  run's: the mark in the lock an earlier launcher left (every ``run`` that got as far as
  starting its job leaves one, :meth:`~nemo_moe_metrics.run_dir.RunDirLock.mark_run`), a
  ``run.json`` of this package, or logged records. Without such proof its entries are refused, never
  deleted.

Deleting means deleting the run's entries by name (:func:`clear_run`), never following
a link, and never anything else in the directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.run_dir.lock import Holder, RunDirLock, read_earlier_lock
from nemo_moe_metrics.run_dir.names import (
    LOCK_FILE,
    METRICS_FILE,
    MLFLOW_ARTIFACTS_DIR,
    MLFLOW_DB,
    RUN_FILE,
    RUN_RECORD,
    STORE_FILE,
    TENSORBOARD_DIR,
    WANDB_DIR,
    is_run_file,
    linked_run_files,
    links_refusal,
)
from nemo_moe_metrics.run_dir.resume import read_resume_state
from nemo_moe_metrics.sinks.tensorboard import logged_steps

#: What to say after the entries a refusal names: the ways on.
ELSEWHERE = "choose another directory (--output-dir DIR, or the override name=NEW_NAME)"


def check_before_lock(run_dir: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before its lock file is created in it, a directory that is not a run's (entries
    a run does not write, or links among its own)."""
    entries = _check_entries(run_dir, resume=resume, overwrite=overwrite)
    # What prepare_run_dir would refuse without the lock's help, refused before the lock file
    # exists, so a refusal leaves no .run.lock in a directory that holds no run. (A live run
    # holding the lock is left to the lock, which names it. Never called holding the lock:
    # probing from the process that holds it would drop its POSIX lock.)
    old = [name for name in entries if name != LOCK_FILE]
    if RunDirLock.probe(run_dir) is not None:
        return
    earlier = read_earlier_lock(run_dir)
    if resume and old and not (logged_run(run_dir) and _proven(run_dir, earlier)):
        foreign = [name for name in old if not is_run_file(name)]
        what = f"files no run wrote ({_shown(foreign)})" if foreign else "a run that logged no step"
        if not foreign and logged_run(run_dir):  # records, but none of them a run's
            what = f"{_shown(old)}, with no mark of a run ({LOCK_FILE}, {RUN_FILE} or a step)"
        raise ConfigError(f"--resume: {run_dir} holds {what}; drop --resume to start a new run")
    if old and not resume and not _proven(run_dir, earlier):
        raise ConfigError(_unproven(run_dir, old))


def _check_entries(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """The directory's entries, after refusing links among a run's own and (unless resuming)
    entries a run does not write."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other; pass one of them")
    entries = _entries(run_dir)
    _refuse_links(run_dir)
    if not resume:
        _refuse_foreign(run_dir, entries, overwrite)
    return entries


def prepare_run_dir(
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    earlier_lock: Holder | None = None,
) -> str | None:
    """Make ``run_dir`` ready for a new run (or a resumed one), by the rules of the module
    docstring; returns a note to print when the leftovers of a run that failed early were
    cleared. ``earlier_lock``: who held the lock before the caller took it
    (:attr:`~nemo_moe_metrics.run_dir.RunDirLock.previous`), whose mark says a run started here.
    Call it holding the directory's lock (the lock file is kept), then mark the lock
    (:meth:`~nemo_moe_metrics.run_dir.RunDirLock.mark_run`) before the run starts."""
    _check_entries(run_dir, resume=resume, overwrite=overwrite)  # held: no probe of the lock
    entries = _entries(run_dir)
    old = [name for name in entries if name != LOCK_FILE]
    logged = logged_run(run_dir) if old else []
    if resume and not old:
        raise ConfigError(
            f"--resume: {run_dir} holds no run to continue; drop --resume to start a new run"
        )
    if resume and not logged:
        raise ConfigError(
            f"--resume: {run_dir} holds a run that logged no step; drop --resume to start a new run"
        )
    if old and not resume and not _proven(run_dir, earlier_lock):
        raise ConfigError(_unproven(run_dir, old))
    try:
        refuse_logged_run(
            run_dir,
            resume=resume or overwrite,
            ways=f"pass --resume to continue it, --overwrite to delete it and start afresh, or "
            f"{ELSEWHERE}",
        )
    except RunExistsError as err:
        raise ConfigError(f"run directory {err}") from None
    note = None
    if old and not resume and not logged and not overwrite:
        note = f"{run_dir}: the earlier run there logged no step (it failed early); starting afresh"
    if old and not resume:
        clear_run(run_dir, [name for name in old if is_run_file(name)])
    run_dir.mkdir(parents=True, exist_ok=True)
    return note


class RunExistsError(FileExistsError):
    """``run_dir`` already holds a run that logged steps, and neither resume nor overwrite was
    asked for (one run per directory, as ``nemo-moe-metrics run`` does)."""


def logged_run(run_dir: Path) -> list[str]:
    """The files of a run in ``run_dir`` that logged at least one step; empty when there is none.

    ``metrics.jsonl`` decides when it exists (a run that failed before logging leaves it empty);
    without it (JSONL off) any TensorBoard, W&B or MLflow output counts as a run.
    """
    run_dir = Path(run_dir)
    # The store starts with its 8-byte magic; a step adds a record after it.
    empty = {METRICS_FILE: 0, STORE_FILE: 8}
    found = [
        name
        for name, size in empty.items()
        if (run_dir / name).is_file() and (run_dir / name).stat().st_size > size
    ]
    if found or (run_dir / METRICS_FILE).is_file():
        # An empty metrics.jsonl beside TensorBoard steps is a damaged run, not an early death.
        if not found and _tensorboard_has_steps(run_dir / TENSORBOARD_DIR):
            found.append(TENSORBOARD_DIR)
        return found
    found = [
        name
        for name in (TENSORBOARD_DIR, WANDB_DIR, MLFLOW_ARTIFACTS_DIR)
        if (run_dir / name).is_dir() and any((run_dir / name).iterdir())
    ]
    if (run_dir / MLFLOW_DB).is_file():
        found.append(MLFLOW_DB)
    return found


def _tensorboard_has_steps(log_dir: Path) -> bool:
    return log_dir.is_dir() and bool(logged_steps(log_dir))


def clear_run(run_dir: Path, names: Iterable[str] = RUN_RECORD) -> list[str]:
    """Delete what a run wrote into ``run_dir`` (``names``, by default :data:`RUN_RECORD`),
    never following a link (a link is removed, its target left alone); returns the names
    removed."""
    removed = []
    for name in names:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def refuse_logged_run(run_dir: Path, *, resume: bool, ways: str) -> None:
    """:class:`RunExistsError` when ``run_dir`` holds a run that logged steps and it is not to
    be continued (``resume``: continued, or deleted first); ``ways`` says what to do instead,
    in the caller's terms (API, recipe, command line)."""
    old = logged_run(run_dir)
    if old and not resume:
        raise RunExistsError(f"{run_dir} already holds a run ({', '.join(old)}); {ways}")


def _entries(run_dir: Path) -> list[str]:
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise ConfigError(
            f"{run_dir} is a file, not a directory: a run writes into the directory "
            f"<--output-dir>/<recipe name>; move the file away, or {ELSEWHERE}"
        )
    return sorted(os.listdir(run_dir)) if run_dir.is_dir() else []


def _refuse_links(run_dir: Path) -> None:
    links = linked_run_files(run_dir)
    if links:
        raise ConfigError(links_refusal(links, ELSEWHERE))


def _refuse_foreign(run_dir: Path, entries: list[str], overwrite: bool) -> None:
    foreign = [name for name in entries if not is_run_file(name)]
    if not foreign:
        return
    shown = ", ".join(str(run_dir / name) for name in foreign[:6])
    more = f" and {len(foreign) - 6} more" if len(foreign) > 6 else ""
    what = "--overwrite deletes only a run's own files, so it" if overwrite else "a run"
    raise ConfigError(
        f"{run_dir} holds files that no run wrote ({shown}{more}); {what} does not start in "
        f"a directory that holds them: move them elsewhere, or {ELSEWHERE}"
    )


def _proven(run_dir: Path, earlier_lock: Holder | None) -> bool:
    """Whether something shows the directory's entries are a run's: the lock an earlier
    launcher left, a ``run.json`` of this package, or a step record in ``metrics.jsonl``."""
    if (earlier_lock is not None and earlier_lock.run_started) or _has_run_json(run_dir):
        return True
    return (
        not (run_dir / METRICS_FILE).is_symlink()
        and read_resume_state(run_dir).last_step is not None
    )


def _has_run_json(run_dir: Path) -> bool:
    """Whether ``run.json`` is one this package wrote (a run id and a run name in it)."""
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "run_id" in data and "run_name" in data


def _unproven(run_dir: Path, old: list[str]) -> str:
    return (
        f"{run_dir} holds {_shown(old)}, named like a run's files but with no mark of a "
        f"run (no {LOCK_FILE} or {RUN_FILE} of nemo-moe-metrics, no logged step), so "
        f"they are not deleted: remove them yourself, or {ELSEWHERE}"
    )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


__all__ = [
    "ELSEWHERE",
    "RUN_RECORD",
    "RunExistsError",
    "check_before_lock",
    "clear_run",
    "logged_run",
    "prepare_run_dir",
    "refuse_logged_run",
]
