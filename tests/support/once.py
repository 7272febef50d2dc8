"""A session's expensive run, made once for all the pytest-xdist workers of one pytest run.

A session fixture runs once per xdist worker (each is a session of its own); the runs the suite
shares (tests/conftest.py) cost a whole launch each, so the first worker to ask makes it under a
file lock beside the workers' temporary folders, and the others wait for it and read its value.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


def once_for_all_workers(tmp_path_factory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(folder)``'s JSON value, made in ``folder`` by the first worker that asks."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # popen-gwN's parent
    folder, value_file = root / f"once_{name}", root / f"once_{name}" / "value.json"
    with open(root / f"once_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
        if value_file.is_file():
            return json.loads(value_file.read_text())
        shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
        folder.mkdir()
        value = make(folder)
        value_file.write_text(json.dumps(value))
        return value


def process_value(proc: subprocess.CompletedProcess) -> dict:
    """A finished process as JSON (:func:`process_from`'s inverse)."""
    return {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout,
            "stderr": proc.stderr}  # fmt: skip


def process_from(value: dict) -> subprocess.CompletedProcess:
    """The finished process :func:`process_value` wrote."""
    return subprocess.CompletedProcess(**value)
