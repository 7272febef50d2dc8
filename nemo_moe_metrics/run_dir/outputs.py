"""Where a command may write: one rule for every file ``placement``, ``ingest`` and ``report``
write, so that none of them writes anything it does not own.

- **A path the user named** (``placement --out PLAN.json``, ``--sglang-out``, ``--vllm-out``,
  ``--sweep-out``) is written only when it does not exist yet; an existing file is replaced
  only with ``--force`` (:func:`check_new_file`), and never when it is one of a run
  directory's own files (``--out RUN/metrics.jsonl`` would replace the run's record). The file
  is written whole into a temporary file beside it, then linked into place (it must still not
  exist) or, with ``--force``, renamed over the old one (:func:`write_new_file`).
- **A run directory** (``ingest sglang --run DIR``, the sweep picture of ``placement``) is
  written only when it is one: every entry a name a run writes
  (:func:`nemo_moe_metrics.run_dir.names.is_run_file`), at least one of them; or, where the
  command may start a run directory, a path that does not exist yet or an empty directory
  (:func:`check_run_dir`). A user's directory (``.git``, ``notes.txt``) is refused whole.
- **A directory of pictures** (``report --out DIR``): a new or empty directory, a run
  directory, or one an earlier report wrote; in any other directory a picture never replaces
  a file of the same name (:func:`check_picture_dir`). The page of ``report --html`` replaces
  only a page an earlier report wrote (:func:`check_report_page`).
- **Never through a link**: a symbolic link where a file would go is refused (even with
  ``--force``), and a file is created with ``O_NOFOLLOW | O_EXCL``.
- **Siblings only by name**: a command writes the files the user named and nothing beside them.

Every refusal is one :class:`OutputError` line naming the path, what is wrong and the way on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from nemo_moe_metrics.run_dir.names import (
    LOCK_FILE,
    METRICS_FILE,
    ROLLOUT_STORE_FILE,
    RUN_FILE,
    STORE_FILE,
    is_run_file,
    linked_run_files,
)

__all__ = [
    "OutputError",
    "check_new_file",
    "check_picture_dir",
    "check_report_page",
    "check_run_dir",
    "write_new_file",
]


# Any of these makes a directory a run's: its own files there are never replaced by a command.
_RUN_MARKS = (METRICS_FILE, STORE_FILE, ROLLOUT_STORE_FILE, RUN_FILE, LOCK_FILE)


class OutputError(ValueError):
    """A path a command may not write; the message names it, why, and what to do instead."""


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def check_new_file(path: Path, *, option: str, force: bool = False) -> Path:
    """``path`` when the file the user named with ``option`` may be written: it does not
    exist yet, or it is a regular file and ``force`` was given, and it is neither a link nor
    one of a run directory's own files; else :class:`OutputError`."""
    path = Path(path)
    where = f"{option} {path}"
    if path.is_symlink():
        raise OutputError(
            f"{where} is a symbolic link (to {_link_target(path)}): nothing is written through "
            "a link or over one, even with --force; remove the link (rm leaves its target "
            "alone) or name another path"
        )
    if path.is_dir():
        raise OutputError(f"{where} is a directory; name a file, e.g. {path / 'PLAN.json'}")
    parent = path.parent
    if os.path.lexists(parent) and not parent.is_dir():
        raise OutputError(f"{where}: {parent} is a file, not a directory; name another path")
    if not os.path.lexists(path):
        return path
    if is_run_file(path.name) and _holds_a_run(parent):
        raise OutputError(
            f"{where} is one of the run's own files in {parent}: a command never replaces "
            "them, even with --force; name a path outside the run's files"
        )
    if not path.is_file():
        raise OutputError(f"{where} exists and is not a regular file; name another path")
    if not force:
        raise OutputError(
            f"{where} exists; pass --force to replace it, or name a path that does not exist"
        )
    return path


def write_new_file(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write ``data`` to ``path`` (checked by :func:`check_new_file`) whole or not at all:
    into a temporary file beside it (``O_EXCL | O_NOFOLLOW``), then linked into place, which
    fails if something appeared there meanwhile; with ``force``, renamed over the old file
    (the directory entry is replaced, nothing is written through a link)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if force and not path.is_symlink():
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise OutputError(
                    f"{path} appeared while it was being written (another process?); nothing "
                    "was replaced: pass --force to replace it, or name another path"
                ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _holds_a_run(directory: Path) -> bool:
    """Whether ``directory`` holds a run's record (its metrics, store, run.json or lock)."""
    return any(os.path.lexists(directory / name) for name in _RUN_MARKS)


def _is_run_dir(directory: Path) -> bool:
    """Whether ``directory`` holds at least one entry, and only names a run writes."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return False
    return bool(entries) and all(is_run_file(name) for name in entries)


def check_run_dir(
    run_dir: Path,
    *,
    option: str,
    create: bool = False,
    fix: str = "name the run directory (or a new path, where the command may start one)",
) -> Path:
    """``run_dir`` when a command may write a run's own file into it: a run directory (only a
    run's entries, none of them a link); with ``create``, also a path that does not exist yet
    or an empty directory (made here). Else :class:`OutputError` naming what is in the way
    and ``fix``, the way on."""
    run_dir = Path(run_dir)
    where = f"{option} {run_dir}"
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise OutputError(f"{where} is a file, not a run directory; name the run's directory")
    if not run_dir.is_dir():
        if not create:
            raise OutputError(f"{where} does not exist; name the run's directory")
        try:
            run_dir.mkdir(parents=True)
        except OSError as err:
            raise OutputError(f"{where}: cannot create it ({err.strerror or err})") from None
        return run_dir
    try:
        entries = sorted(os.listdir(run_dir))
    except OSError as err:
        raise OutputError(f"{where}: cannot list it ({err.strerror or err})") from None
    if not entries and not create:
        raise OutputError(f"{where} is empty: it holds no run; name the run's directory")
    foreign = [name for name in entries if not is_run_file(name)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise OutputError(
            f"{where} is not a run directory: it holds {shown}, which no run writes, and a "
            f"command writes only into a run's own directory; {fix}"
        )
    links = linked_run_files(run_dir)
    if links:
        raise OutputError(
            f"{where}: {', '.join(links)}: a run's own files must not be symbolic links (nothing "
            "is written through one); remove the link(s) (rm leaves the target alone)"
        )
    return run_dir


def check_picture_dir(out_dir: Path, names: Iterable[str]) -> Path:
    """``out_dir`` when pictures called ``names`` may be written into it (made when it does
    not exist): in a directory that holds anything but a run's (or an earlier report's)
    entries, no picture replaces a file of the same name; no picture replaces a link."""
    out_dir = Path(out_dir)
    where = f"cannot write the pictures into {out_dir}"
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise OutputError(f"{where}: it is a file, not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".nemo_moe_metrics_write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise OutputError(f"{where}: {err.strerror or err}; choose a writable directory") from None
    own = _is_run_dir(out_dir)
    for name in names:
        path = out_dir / name
        if path.is_symlink():
            raise OutputError(
                f"{where}: {path} is a symbolic link (to {_link_target(path)}) and a picture is "
                "never written over one; remove it (rm leaves its target alone) or choose "
                "another directory"
            )
        if os.path.lexists(path) and not own:
            raise OutputError(
                f"{where}: {path} exists, and {out_dir} holds files no report wrote, so the "
                "picture would replace it; choose a new or empty directory (or move the file)"
            )
        if os.path.lexists(path) and not _is_png(path):
            raise OutputError(
                f"{where}: {path} exists and is no picture a report drew (not a PNG file), so "
                "it is not replaced; move it, or choose a new or empty directory"
            )
    return out_dir


def check_report_page(folder: Path, name: str, earlier: Callable[[Path], bool]) -> Path:
    """``folder / name``, the page a report writes, checked before anything is written: no
    link on the way, no file where the folder should be, and an existing page replaced only
    when ``earlier(page)`` says an earlier report wrote it."""
    folder = Path(folder)
    if folder.is_symlink():
        raise OutputError(
            f"{folder} is a symbolic link (to {_link_target(folder)}) and a report never writes "
            "through one: give the real directory"
        )
    if os.path.lexists(folder) and not folder.is_dir():
        raise OutputError(f"cannot write {name} into {folder}: it is a file, not a directory")
    page = folder / name
    if page.is_symlink():
        raise OutputError(
            f"{page} is a symbolic link (to {_link_target(page)}) and a report never writes "
            "through one: remove the link (rm leaves its target alone) or choose another --out"
        )
    if os.path.lexists(page) and not earlier(page):
        raise OutputError(
            f"{page} exists and no report wrote it, so it is not replaced; move it aside or "
            "choose another --out DIR"
        )
    return page


def _is_png(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return path.is_file() and f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False
