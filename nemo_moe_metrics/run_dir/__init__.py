"""The run directory and its one owner: what it holds, who may write it, how a run opens.

- :mod:`~nemo_moe_metrics.run_dir.names`: every name a run directory holds;
- :mod:`~nemo_moe_metrics.run_dir.lock`: the owner lock every writer takes (:class:`RunDirLock`);
- :mod:`~nemo_moe_metrics.run_dir.record`: one run per directory, what may be deleted;
- :mod:`~nemo_moe_metrics.run_dir.resume`: where a resumed run continues, the records cut to agree;
- :mod:`~nemo_moe_metrics.run_dir.run_json`: ``run.json``, the run's identity and model shape;
- :mod:`~nemo_moe_metrics.run_dir.session`: :func:`~nemo_moe_metrics.run_dir.session.open_run`,
  the one way every integration opens a run directory (lock, rules, resume, ``run.json``,
  sinks), and ``build_sinks`` on top of it.

The lock's names are re-exported here (``from nemo_moe_metrics.run_dir import RunDirLock``).
"""

from __future__ import annotations

from nemo_moe_metrics.run_dir.lock import (
    LOCK_FILE,
    TOKEN_ENV,
    Holder,
    RunDirBusyError,
    RunDirError,
    RunDirLock,
    lock_path,
    parse_holder,
    read_earlier_lock,
    this_command,
)

__all__ = [
    "LOCK_FILE",
    "TOKEN_ENV",
    "Holder",
    "RunDirBusyError",
    "RunDirError",
    "RunDirLock",
    "lock_path",
    "parse_holder",
    "read_earlier_lock",
    "this_command",
]
