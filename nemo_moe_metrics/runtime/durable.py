"""Writes that survive a crash or a disk error: atomic replacement, with the data and the
directory entry on the device (fsync) before the call returns.

``run.json`` and ``recipe.yaml`` are written this way; the JSONL, the expert-load store and
the TensorBoard event file fsync each step where they append (their own modules).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text_durably(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` atomically (a reader sees the old file or the new one,
    never a part) and durably (file and directory fsync'd). A link at ``path`` is replaced,
    its target left alone."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as err:
        # Name the file the caller asked for, not the random temporary name beside it.
        why = (
            f"{err.strerror}: cannot create {path.name} in {path.parent}; "
            "make it writable or choose another directory"
        )
        raise type(err)(err.errno, why, str(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; the run's files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Put ``directory``'s entries (a file created or renamed in it) on the device."""
    _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)


def fsync_path(path: Path) -> None:
    """Put ``path``'s written data on the device (for files another library writes)."""
    _fsync(path, os.O_RDONLY | os.O_NOFOLLOW)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["fsync_dir", "fsync_path", "write_text_durably"]
