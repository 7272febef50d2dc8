"""The launcher owns its ranks: find, stop and outlive-proof the processes a run starts.

``nemo-moe-metrics run`` starts ``python -m nemo_moe_metrics.launch`` (nemo-run), which starts
torchrun, which starts one process per rank; torchrun and the ranks each run in a session of
their own, so a terminal's Ctrl-C or a ``kill`` of ``run`` reaches none of them. Three layers
make sure they end with the launcher:

1. ``run`` is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose parent dies is
   re-parented to ``run``, so :func:`descendants` still finds it; on Ctrl-C, SIGTERM or SIGHUP,
   and when the launch process ends, ``run`` stops every descendant (:func:`terminate`).
2. The launch process dies with ``run`` (``PR_SET_PDEATHSIG``: SIGTERM when ``run`` is killed,
   even by SIGKILL) and stops its own descendants on that signal.
3. Every rank watches ``run`` (:func:`watch_launcher`): when that process is gone, or the rank's
   own parent (torchrun) is, the rank exits within about a second. This covers what 1 and 2
   cannot: ``kill -9`` of ``run`` and of the launch process together.

Processes are named by pid and start time (``/proc/<pid>/stat``), so a reused pid is never
mistaken for the original. Linux only (``/proc`` and ``prctl``); elsewhere the functions do
nothing and say so by their return values.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

#: Set by ``nemo-moe-metrics run`` for its children: ``"<pid>:<start ticks>"`` of ``run``.
LAUNCHER_ENV = "NEMO_MOE_METRICS_LAUNCHER"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), or None when there is no such process."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == b"Z":  # a zombie has ended; only its exit status is left
        return None
    return int(fields[19])


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``T``: stopped, ``Z``: ended), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def identity(pid: int | None = None) -> str:
    """``"<pid>:<start ticks>"`` of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_ticks(pid) or 0}"


def is_alive(pid: int, ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (and, when ``ticks`` is given, is the process that started then)."""
    now = start_ticks(pid)
    if now is None:
        if os.path.isdir("/proc/self"):
            return False
        try:  # no /proc: the signal-0 probe (cannot tell a reused pid)
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return ticks is None or ticks == 0 or now == ticks


def alive_identity(text: str | None) -> bool:
    """Whether the process ``"<pid>:<ticks>"`` (as :func:`identity` writes it) still runs."""
    pid, ticks = _parse_identity(text)
    return pid is not None and is_alive(pid, ticks)


def _parse_identity(text: str | None) -> tuple[int | None, int | None]:
    try:
        pid, _, ticks = (text or "").partition(":")
        return int(pid), int(ticks or 0)
    except ValueError:
        return None, None


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children first), found through ``/proc``'s parent links."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it ended meanwhile
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def terminate(
    pids: Iterable[int], grace_s: float = 10.0, force: Callable[[], bool] | None = None
) -> list[int]:
    """SIGTERM each of ``pids``, wait up to ``grace_s`` for them to end, then SIGKILL the rest.

    ``force()`` returning True (a second Ctrl-C) sends SIGKILL at once. Children of this
    process are reaped. Returns the pids that were still running when SIGKILL was sent.
    """
    targets = {pid: start_ticks(pid) for pid in pids}
    targets = {pid: t for pid, t in targets.items() if t is not None}
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        _reap(targets)
        left = [pid for pid, t in targets.items() if is_alive(pid, t)]
        if not left or time.monotonic() >= deadline or (force is not None and force()):
            break
        time.sleep(0.05)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    for _ in range(100):  # SIGKILL ends a process within milliseconds; reap what we own
        _reap(targets)
        if not any(is_alive(pid, t) for pid, t in targets.items()):
            break
        time.sleep(0.02)
    return left


def stop_descendants(
    root: int | None = None, grace_s: float = 10.0, force: Callable[[], bool] | None = None
) -> int:
    """Stop every process below ``root`` (default: this process), sweeping again for processes
    started meanwhile; returns how many were stopped."""
    root = os.getpid() if root is None else root
    stopped: set[int] = set()
    for _ in range(5):
        found = [pid for pid in descendants(root) if pid not in stopped]
        if not found:
            break
        terminate(found, grace_s, force)
        stopped.update(found)
    return len(stopped)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children (so they can still be found and
    stopped); False where the system has no such feature."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(expected_parent: int, sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (even by SIGKILL).

    If the parent already ended before the request (this process is then an orphan), ``sig``
    is sent at once. False where the system has no such feature.
    """
    ok = _prctl(_PR_SET_PDEATHSIG, int(sig))
    if ok and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return ok


def watch_launcher(
    launcher: str | None,
    *,
    label: str,
    interval_s: float = 0.5,
    on_gone: Callable[[str], None] | None = None,
) -> threading.Thread:
    """Exit this process when the launcher ``"<pid>:<ticks>"`` or this process's parent ends.

    A daemon thread checks every ``interval_s``; when either is gone it prints one line
    (``label`` says which process this is) and ends the process with status 1 at once: the
    run's files are crash-safe, and a resumed run continues after the last complete step.
    ``on_gone`` replaces the exit (for tests).
    """
    parent = os.getppid()

    def gone() -> str | None:
        if launcher and not alive_identity(launcher):
            return f"the launcher (pid {launcher.partition(':')[0]}) has ended"
        if os.getppid() != parent:
            return f"its parent process (pid {parent}) has ended"
        return None

    def loop() -> None:
        while True:
            why = gone()
            if why is not None:
                if on_gone is not None:
                    on_gone(why)
                    return
                with contextlib.suppress(OSError):
                    os.write(2, f"{label}: {why}; stopping\n".encode())
                os._exit(1)
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="nmm-launcher-watch", daemon=True)
    thread.start()
    return thread


#: Exit statuses of a run that a signal stopped: 128 + the signal number (the shell's habit).
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """A stopping signal (SIGINT, SIGTERM, SIGHUP) arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal number: 130 for Ctrl-C."""
        return SIGNAL_EXIT.get(self.signum, 128 + self.signum)


@contextlib.contextmanager
def signals_raise(sigs: Iterable[int] = tuple(SIGNAL_EXIT)) -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main
    thread (Python turns only SIGINT into an exception by itself); the old handlers return
    afterwards. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def signals_counted(sigs: Iterable[int] = tuple(SIGNAL_EXIT)) -> Iterator[Callable[[], bool]]:
    """Within the block, stopping signals are counted instead of acted on; yields a function
    that is True once another one arrived (a second Ctrl-C: stop waiting, kill at once)."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    old = {sig: signal.signal(sig, lambda signum, frame: seen.append(signum)) for sig in sigs}
    try:
        yield lambda: bool(seen)
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
