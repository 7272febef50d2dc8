"""One owner per run directory: the lock every launcher takes before it writes or deletes.

``nemo-moe-metrics run`` (with or without ``--resume`` / ``--overwrite``) takes the lock of the
run directory before anything in it is written or deleted, and holds it until its ranks have
ended; rank 0 of the training job joins it as the directory's writer. A job started some other
way (``torchrun -m nemo_moe_metrics.train`` on a Slurm node) is its own owner: its rank 0 takes
the lock itself. A second owner is refused with who holds the directory (host, pid, since when,
command)::

    from nemo_moe_metrics.run_dir import RunDirLock, RunDirBusyError

    with RunDirLock(run_dir, command="my_launcher ...") as lock:   # raises RunDirBusyError
        for note in lock.notes:   # e.g. a stale lock of a killed run that was taken over
            print(note)
        ...  # write into run_dir

    holder = RunDirLock.probe(run_dir)   # who holds it now (None: free), e.g. before submitting

How it works (``<run_dir>/.run.lock``):

- POSIX record locks (``fcntl.lockf``) on two bytes of the file: byte 0 for the owner (the
  launcher), byte 1 for the writer (rank 0). The kernel drops a process's locks when it dies,
  however it dies, so a lock left by a killed run is never mistaken for a live one. POSIX
  locks are what NFS's lock manager implements (NFSv3 with ``lockd``, NFSv4 natively), so they
  hold between the hosts of a cluster sharing the run directory; ``flock`` is not forwarded by
  every NFS client, Lustre needs the ``flock`` mount option for either.
- The file's text says who holds it (JSON: host, pid, start time, command, a token the ranks
  are given to join) and the owner refreshes its modification time every
  :data:`HEARTBEAT_S` seconds. That covers file systems where record locks are missing
  (``ENOLCK``) or do not reach other hosts (NFS mounted with ``nolock``): a holder on this host
  is alive when its pid still runs with the same start time; on another host, when its
  heartbeat still moves (a new owner waits up to two heartbeats to see it; a file untouched
  for :data:`STALE_AFTER_S` seconds is stale at once).
- A lock whose holder is gone (killed, crashed, node lost) is stale: the next owner takes it
  over and says so (:attr:`RunDirLock.notes`). A run that ends normally marks the file
  released. Between an owner killed by SIGKILL and its ranks noticing (about a second), the
  writer byte is still held: a new owner waits up to ``wait_for_writer_s`` for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from nemo_moe_metrics.run_dir.names import LOCK_FILE
from nemo_moe_metrics.runtime import processes

#: Set by the owner for the ranks it starts: the token rank 0 joins the lock with.
TOKEN_ENV = "NEMO_MOE_METRICS_RUN_LOCK"
#: The owner touches the lock file this often; a holder on another host whose file is older
#: than STALE_AFTER_S is taken to be gone (where record locks do not reach that host).
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0

_OWNER_BYTE, _WRITER_BYTE = 0, 1
# Errors meaning "this file system has no working record locks" (not "someone holds it").
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# POSIX locks belong to the process: closing any descriptor of the file drops them all. So one
# process opens each lock file once (keyed by device and inode) and reuses that descriptor.
_OPEN: dict[tuple[int, int], int] = {}
_HELD: dict[tuple[int, int], set[int]] = {}
_OPEN_GUARD = threading.Lock()


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message says why and what to do."""


class RunDirBusyError(RunDirError):
    """The run directory belongs to a live run (or its ranks still write there)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    pid: int
    started: str  # ISO time (UTC) the lock was taken
    command: str
    start_ticks: int = 0  # the process's start time, to tell a reused pid
    token: str = ""
    released: bool = False
    writer_host: str = ""
    writer_pid: int = 0
    writer_ticks: int = 0
    #: A run was started in the directory under this lock (:meth:`RunDirLock.mark_run`): the
    #: mark that makes a directory a run's even when it failed before it logged a step.
    run_started: bool = False

    def describe(self, now: float | None = None) -> str:
        """``nemo-moe-metrics run ... (pid 123 on host h, since 2026-..., 5 min ago)``."""
        return (
            f"{self.command} (pid {self.pid} on host {self.host}, since "
            f"{self.started}{_ago(self.started, now)})"
        )


def _ago(started: str, now: float | None) -> str:
    try:
        then = datetime.fromisoformat(started).timestamp()
    except ValueError:
        return ""
    seconds = max(0, int((time.time() if now is None else now) - then))
    if seconds < 120:
        return f", {seconds} s ago"
    if seconds < 7200:
        return f", {seconds // 60} min ago"
    return f", {seconds / 3600:.1f} h ago"


def lock_path(run_dir: Path) -> Path:
    """Where a run directory keeps its lock (a hidden file inside it)."""
    return Path(run_dir) / LOCK_FILE


def this_command() -> str:
    """The command line of this process, as a shell would take it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py")):
        argv[0] = "nemo-moe-metrics"
    return shlex.join(argv) if argv else "python"


class RunDirLock:
    """The lock of one run directory; see the module docstring. Not reentrant.

    ``acquire()`` takes it as the owner (launchers), ``join(token)`` as the writer of the job
    the owner started (rank 0, given the owner's :attr:`token`), ``acquire(writer=True)`` as
    both (a job that launched itself). ``release()`` (or leaving the ``with`` block) gives it
    back; the process ending gives it back too, however it ends.
    """

    def __init__(self, run_dir: Path, *, command: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = lock_path(self.run_dir)
        self.command = command or this_command()
        self.token = uuid.uuid4().hex
        #: Things worth telling the user (a stale lock taken over, a writer waited for).
        self.notes: list[str] = []
        self._key: tuple[int, int] | None = None
        self._fd: int | None = None
        self._bytes: list[int] = []
        #: Who held the lock before this one took it (None: nobody, or a file it cannot read),
        #: read in :meth:`acquire`; its ``run_started`` marks the directory as a run's, even
        #: one that failed before it logged a step.
        self.previous: Holder | None = None
        self._kernel_locks = True
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------------ taking it

    def acquire(self, *, writer: bool = False, wait_for_writer_s: float = 15.0) -> RunDirLock:
        """Take the lock as owner (``writer=True``: as the writer too); raise
        :class:`RunDirBusyError` naming the holder when a live run holds it."""
        self._open()
        try:
            previous = self._read()
            self.previous = previous if previous is not None and previous.pid else None
            # The wait: a probe elsewhere may hold the byte for a moment (shared, to look).
            if not self._lock(_OWNER_BYTE, wait_s=1.0) or self._alive_elsewhere(previous):
                raise RunDirBusyError(self._busy_text(previous))
            self._wait_for_writer(previous, wait_for_writer_s)
            if previous is not None and not previous.released and previous.token != self.token:
                said = "took over the lock of a run that ended without releasing it"
                self.notes.append(
                    f"{self.run_dir}: {said} (it was killed or crashed): {previous.describe()}"
                )
            holder = self._holder()
            if writer:
                self._lock(_WRITER_BYTE)
                holder = _with_writer(holder)
            self._write(holder)
            self._start_heartbeat()
        except BaseException:
            self._close()
            raise
        return self

    def join(self, token: str) -> RunDirLock:
        """Take the writer byte for the job whose owner holds the lock with ``token``."""
        self._open()
        try:
            holder = self._read()
            if holder is None or holder.token != token or holder.released:
                who = holder.describe() if holder and not holder.released else "nobody"
                raise RunDirBusyError(
                    f"{self.run_dir}: the launcher that started this job no longer holds the "
                    f"run directory (its lock is held by {who}); this rank stops without "
                    "writing. Start the run again (nemo-moe-metrics run ... --resume)"
                )
            if not self._lock(_WRITER_BYTE, wait_s=15.0):
                raise RunDirBusyError(
                    f"{self.run_dir}: rank 0 of another job still writes here "
                    f"({_writer_text(holder)}); this rank stops without writing"
                )
            self.token = token
            self._write(_with_writer(holder))
        except BaseException:
            self._close()
            raise
        return self

    def mark_run(self) -> None:
        """Record in the lock that a run starts in the directory (see :attr:`Holder.run_started`);
        call it once the directory was found fit for the run, before the job starts."""
        holder = self._read()
        if holder is None or holder.token != self.token:
            raise RunDirBusyError(f"{self.run_dir}: this process does not hold its lock")
        self._write(Holder(**{**asdict(holder), "run_started": True}))

    @classmethod
    def probe(cls, run_dir: Path) -> Holder | None:
        """Who holds ``run_dir`` now, or None when it is free (taking nothing)."""
        lock = cls(run_dir)
        if not lock.path.is_file() and not lock.path.is_symlink():
            return None
        lock._open(create=False)
        try:
            holder = lock._read()
            if lock._key is not None and _HELD.get(lock._key):
                return holder  # this very process holds it
            # A shared lock, let go at once: probes never see each other as holders, and an
            # owner taking the lock meanwhile is not refused because someone looked.
            unlocked = lock._lock(_OWNER_BYTE, shared=True)
        finally:
            lock._close()
        return None if unlocked and not lock._alive_elsewhere(holder) else holder

    def release(self) -> None:
        """Mark the lock released and give it back (idempotent)."""
        self._stop.set()
        if self._fd is None:
            return
        with contextlib.suppress(OSError, ValueError):
            holder = self._read()
            if holder is not None and holder.token == self.token and _OWNER_BYTE in self._bytes:
                self._write(Holder(**{**asdict(holder), "released": True}))
        self._close()

    def __enter__(self) -> RunDirLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ internals

    def _open(self, create: bool = True) -> None:
        if create:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        shared = self._shared_descriptor()
        if shared is not None:  # this process has it open: never open (and close) another
            key, fd = shared
            if _HELD.get(key) and create:
                self._refuse_second_holder(fd)
            self._fd, self._key = fd, key
            return
        # O_NOFOLLOW: the lock is rewritten, so a link in its place would rewrite its target.
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise RunDirError(_link_text(self.path)) from None
            raise
        st = os.fstat(fd)
        if st.st_nlink > 1 or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RunDirError(
                f"{self.path} is not a file of its own (it has {st.st_nlink} hard links, or is "
                "not a regular file): the lock is rewritten, which would change the other "
                "names too. Remove it (rm, not the file it shares), then run again"
            )
        key = (st.st_dev, st.st_ino)
        with _OPEN_GUARD:
            if key in _OPEN:  # another thread opened it since the check: reuse its descriptor
                os.close(fd)
                if _HELD.get(key) and create:
                    self._refuse_second_holder(_OPEN[key])
                fd = _OPEN[key]
            else:
                _OPEN[key] = fd
                _HELD[key] = set()
        self._fd, self._key = fd, key

    def _shared_descriptor(self) -> tuple[tuple[int, int], int] | None:
        """``(key, descriptor)`` when this process already has the lock file open. Found by the
        file's identity before opening it: closing a second descriptor of the file would drop
        every POSIX lock this process holds on it (the holder's too)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        with _OPEN_GUARD:
            fd = _OPEN.get(key)
        return (key, fd) if fd is not None else None

    def _refuse_second_holder(self, fd: int) -> None:
        holder = parse_holder(os.pread(fd, 1 << 16, 0))
        who = holder.describe() if holder is not None else this_command()
        raise RunDirBusyError(
            f"{self.run_dir} is already held by this process, by another writer: {who}. One "
            "writer per run directory: let it finish, or choose another run directory"
        )

    def _close(self) -> None:
        self._stop.set()
        if self._fd is None or self._key is None:
            return
        with _OPEN_GUARD:
            held = _HELD.get(self._key, set())
            for byte in self._bytes:
                with contextlib.suppress(OSError):
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, byte, os.SEEK_SET)
                held.discard(byte)
            if not held:
                _OPEN.pop(self._key, None)
                _HELD.pop(self._key, None)
                os.close(self._fd)
        self._fd, self._key, self._bytes = None, None, []

    def _lock(self, byte: int, wait_s: float = 0.0, *, shared: bool = False) -> bool:
        """Take one byte's record lock; False when someone else holds it (after ``wait_s``)."""
        assert self._fd is not None and self._key is not None
        deadline = time.monotonic() + wait_s
        kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        while True:
            try:
                fcntl.lockf(self._fd, kind | fcntl.LOCK_NB, 1, byte, os.SEEK_SET)
            except OSError as err:
                if err.errno in _NO_LOCKS:
                    self._kernel_locks = False  # judged from the file's text instead
                elif err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                elif time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                else:
                    return False
            self._bytes.append(byte)
            _HELD[self._key].add(byte)
            return True

    def _writer_free(self) -> bool:
        if not self._lock(_WRITER_BYTE):
            return False
        self._bytes.remove(_WRITER_BYTE)
        assert self._key is not None and self._fd is not None
        _HELD[self._key].discard(_WRITER_BYTE)
        with contextlib.suppress(OSError):
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WRITER_BYTE, os.SEEK_SET)
        return True

    def _wait_for_writer(self, previous: Holder | None, wait_s: float) -> None:
        """An owner killed by SIGKILL leaves ranks that need about a second to notice."""
        deadline = time.monotonic() + wait_s
        while not self._writer_free() or self._writer_alive_here(previous):
            if time.monotonic() >= deadline:
                raise RunDirBusyError(
                    f"{self.run_dir}: rank 0 of an earlier run still writes here "
                    f"({_writer_text(previous)}), although its launcher is gone; it should "
                    "stop by itself within seconds: wait, or stop it (kill that pid), then "
                    "run again"
                )
            time.sleep(0.2)

    def _writer_alive_here(self, holder: Holder | None) -> bool:
        # Without record locks, the pid of a writer on this host decides.
        if self._kernel_locks or holder is None or not holder.writer_pid:
            return False
        if holder.writer_host != socket.gethostname() or holder.token == self.token:
            return False
        return processes.is_alive(holder.writer_pid, holder.writer_ticks)

    def _alive_elsewhere(self, holder: Holder | None) -> bool:
        """The text names a live holder that the record lock did not show: no working record
        locks here, or locks that do not reach the holder's host (NFS mounted ``nolock``)."""
        if holder is None or holder.released or holder.token == self.token:
            return False
        if holder.host == socket.gethostname():
            # With working record locks the lock decides on this host; without, the pid does.
            return not self._kernel_locks and processes.is_alive(holder.pid, holder.start_ticks)
        age = self._heartbeat_age()
        if age is None or age >= STALE_AFTER_S:
            return False
        # A live owner touches the file every HEARTBEAT_S: wait to see whether it still does.
        stamp = os.stat(self.path).st_mtime
        deadline = time.monotonic() + max(0.0, 2 * HEARTBEAT_S - age)
        self.notes.append(
            f"{self.run_dir}: its lock names a run on host {holder.host}; waited to see "
            "whether that run is alive (its heartbeat)"
        )
        while time.monotonic() < deadline:
            time.sleep(0.5)
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_mtime != stamp:
                    return True
        return False

    def _heartbeat_age(self) -> float | None:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except OSError:
            return None

    def _holder(self) -> Holder:
        return Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=datetime.now(UTC).isoformat(timespec="seconds"),
            command=self.command,
            start_ticks=processes.start_ticks(os.getpid()) or 0,
            token=self.token,
        )

    def _read(self) -> Holder | None:
        assert self._fd is not None
        for _ in range(5):  # a holder may be rewriting it this instant
            raw = os.pread(self._fd, 1 << 16, 0)
            if not raw.strip():
                return None
            holder = parse_holder(raw)
            if holder is not None:
                return holder
            time.sleep(0.05)
        return Holder(host="?", pid=0, started="?", command="(lock file unreadable)")

    def _write(self, holder: Holder) -> None:
        assert self._fd is not None
        data = (json.dumps(asdict(holder), indent=1) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _busy_text(self, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else "a process that has not said who"
        return (
            f"{self.run_dir} is in use by another run: {who}. Wait for it to end, or stop it "
            "(Ctrl-C in its terminal, or kill that pid on that host), then run again "
            "(--resume continues it)"
        )

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._heartbeat = threading.Thread(target=beat, name="nmm-run-lock", daemon=True)
        self._heartbeat.start()


def parse_holder(raw: bytes) -> Holder | None:
    """The holder a lock file's text names, or None when the text is not a lock's."""
    try:
        data = json.loads(raw)
        holder = Holder(**{k: v for k, v in data.items() if k in Holder.__annotations__})
    except (ValueError, TypeError, AttributeError):
        return None
    return holder if isinstance(holder.pid, int) and holder.pid > 0 else None


def read_earlier_lock(run_dir: Path) -> Holder | None:
    """The holder ``run_dir``'s lock file names, read without taking it (nor following a
    link); None when there is no lock file of a run there."""
    shared = RunDirLock(run_dir)._shared_descriptor()
    if shared is not None:  # held here: read through that descriptor (closing one drops locks)
        return parse_holder(os.pread(shared[1], 1 << 16, 0))
    try:
        fd = os.open(lock_path(run_dir), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return parse_holder(os.read(fd, 1 << 16))
    finally:
        os.close(fd)


def _link_text(path: Path) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{path} is a symbolic link (to {target}): a run writes only inside its own directory, "
        "never through a link. Remove the link (rm, which leaves its target alone), or choose "
        "another directory (--output-dir DIR, or the override name=NEW_NAME)"
    )


def _with_writer(holder: Holder) -> Holder:
    return Holder(
        **{
            **asdict(holder),
            "writer_host": socket.gethostname(),
            "writer_pid": os.getpid(),
            "writer_ticks": processes.start_ticks(os.getpid()) or 0,
        }
    )


def _writer_text(holder: Holder | None) -> str:
    if holder is None or not holder.writer_pid:
        return "pid unknown"
    return f"pid {holder.writer_pid} on host {holder.writer_host}, started by {holder.command}"


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
]
