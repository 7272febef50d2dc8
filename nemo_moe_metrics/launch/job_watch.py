"""Watching a running job's processes for the faults that make no error: a stopped process.

A rank stopped by SIGSTOP (or a terminal's Ctrl-Z) makes the other ranks wait in their next
collective until its timeout, and they are then the ones that fail; a stopped torchrun or
launch process answers nobody, and ``run`` would wait for it for ever. ``nemo-moe-metrics run``
looks at its job's processes every few seconds (:class:`JobWatch`): a stopped rank is named
at once (and again if the run then fails), a launcher stopped for longer than
:data:`LAUNCHER_TIMEOUT_S` (environment variable :data:`LAUNCHER_TIMEOUT_ENV`) ends the run:
its job is stopped and the run can be continued with ``--resume``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime

from nemo_moe_metrics.runtime import processes

#: Seconds a launcher (the launch process or torchrun) may stay stopped before ``run`` gives
#: up on it and stops the job; set :data:`LAUNCHER_TIMEOUT_ENV` to change it.
LAUNCHER_TIMEOUT_S = 120.0
LAUNCHER_TIMEOUT_ENV = "NEMO_MOE_METRICS_LAUNCHER_TIMEOUT_S"
#: Seconds a rank must stay stopped before it is named (a debugger's brief stop is not news).
RANK_STOPPED_S = 5.0


def launcher_timeout_s() -> float:
    """:data:`LAUNCHER_TIMEOUT_S`, or the positive number of seconds in the environment."""
    try:
        value = float(os.environ.get(LAUNCHER_TIMEOUT_ENV, ""))
    except ValueError:
        return LAUNCHER_TIMEOUT_S
    return value if value > 0 else LAUNCHER_TIMEOUT_S


def role(pid: int, launch_pid: int) -> str:
    """``rank 1 (pid 123)``, ``torchrun (pid 120)`` or ``the launch process (pid 118)``."""
    if pid == launch_pid:
        return f"the launch process (pid {pid})"
    rank = _environ(pid).get("RANK")
    if rank is not None and "nemo_moe_metrics.train" in _cmdline(pid):
        return f"rank {rank} (pid {pid})"
    if "torchrun" in _cmdline(pid) or "torch.distributed.run" in _cmdline(pid):
        return f"torchrun (pid {pid})"
    return f"process {pid} ({_cmdline(pid)[:60]})"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


@dataclass
class JobWatch:
    """What ``run`` found about its job's processes while it ran (see the module docstring)."""

    launch_pid: int
    timeout_s: float = field(default_factory=launcher_timeout_s)
    #: pid -> (role, monotonic time it was first seen stopped, wall-clock time)
    stopped: dict[int, tuple[str, float, float]] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)

    def look(self, now: float | None = None) -> tuple[list[str], str | None]:
        """Look at the job once: lines to print now (a rank found stopped), and the reason to
        give up on the job (a launcher stopped for longer than the timeout), or None."""
        now = time.monotonic() if now is None else now
        pids = [self.launch_pid, *processes.descendants(self.launch_pid)]
        lines: list[str] = []
        for pid in pids:
            state = processes.proc_state(pid)
            if state not in ("T", "t"):
                if state is not None:  # it goes on (a gone one stays on record for the report)
                    self.stopped.pop(pid, None)
                continue
            if pid not in self.stopped:
                self.stopped[pid] = (role(pid, self.launch_pid), now, time.time())
            who, since, _ = self.stopped[pid]
            if who.startswith("rank ") and now - since >= RANK_STOPPED_S and pid not in self.named:
                self.named.add(pid)
                lines.append(
                    f"{who} is stopped (SIGSTOP, or Ctrl-Z in a terminal): the other ranks wait "
                    f"for it in their next collective; kill -CONT {pid} lets it go on"
                )
            if not who.startswith("rank ") and now - since >= self.timeout_s:
                return lines, (
                    f"{who} was stopped (SIGSTOP) and answered nothing for {now - since:.0f} s "
                    f"(the limit is {self.timeout_s:.0f} s, {LAUNCHER_TIMEOUT_ENV}): the job "
                    "was stopped"
                )
        return lines, None

    def failure_lines(self) -> list[str]:
        """Lines for the failure report: the ranks found stopped, which the others waited for."""
        return [
            f"{who} was stopped (SIGSTOP) from {datetime.fromtimestamp(wall):%H:%M:%S}: the "
            "other ranks' errors below are their waiting for it giving up"
            for pid, (who, _, wall) in self.stopped.items()
            if pid in self.named
        ]


__all__ = [
    "LAUNCHER_TIMEOUT_ENV",
    "LAUNCHER_TIMEOUT_S",
    "RANK_STOPPED_S",
    "JobWatch",
    "launcher_timeout_s",
    "role",
]
