"""One owner per run directory: the lock, its holder's name, stale locks, writers, probes.

The holders here are real separate processes (a POSIX record lock never conflicts within one
process); the file systems without working record locks are simulated by making ``lockf`` fail
with ENOLCK, as it does there. The lock through the real CLI and torchrun: e2e/test_run_faults.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_moe_metrics.run_dir import LOCK_FILE, RunDirBusyError, RunDirLock
from nemo_moe_metrics.run_dir import lock as lock_module
from nemo_moe_metrics.runtime import processes

REPO = Path(__file__).resolve().parents[2]
_HOLDER = (
    "import sys, time\n"
    "from nemo_moe_metrics.run_dir import RunDirLock\n"
    "lock = RunDirLock(sys.argv[1], command='train --big-model')"
    ".acquire(writer='w' in sys.argv[2])\n"
    "print(lock.token, flush=True)\n"
    "time.sleep(120)\n"
)


def _holder(path: Path, mode: str = "") -> tuple[subprocess.Popen, str]:
    """A process holding ``path``'s lock (``mode`` 'w': as owner and writer); its token."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path), mode or "-"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    token = proc.stdout.readline().strip()
    assert token, "the holder did not start"
    return proc, token


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_a_second_owner_is_refused_with_host_pid_start_time_and_command(tmp_path):
    proc, _ = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusyError) as err:
            RunDirLock(tmp_path).acquire()
        text = str(err.value)
        assert f"{tmp_path} is in use by another run: train --big-model" in text
        assert f"(pid {proc.pid} on host {socket.gethostname()}, since 20" in text
        assert " s ago). Wait for it to end, or stop it" in text
        holder = RunDirLock.probe(tmp_path)
        assert (holder.pid, holder.command) == (proc.pid, "train --big-model")
    finally:
        _end(proc)


def test_a_killed_owners_lock_is_taken_over_and_reported_as_stale(tmp_path):
    proc, _ = _holder(tmp_path)
    _end(proc)  # SIGKILL: no release, the file still names it
    assert json.loads((tmp_path / LOCK_FILE).read_text())["released"] is False
    assert RunDirLock.probe(tmp_path) is None
    lock = RunDirLock(tmp_path, command="again").acquire()
    try:
        [note] = lock.notes
        assert "took over the lock of a run that ended without releasing it" in note
        assert f"pid {proc.pid}" in note and "train --big-model" in note
    finally:
        lock.release()
    # A clean release is not stale.
    assert json.loads((tmp_path / LOCK_FILE).read_text())["released"] is True
    with RunDirLock(tmp_path) as again:
        assert again.notes == []


def test_the_writer_of_a_dead_owner_is_waited_for_then_named(tmp_path):
    owner = RunDirLock(tmp_path, command="owner").acquire()
    token = owner.token
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom nemo_moe_metrics.run_dir import RunDirLock\n"
            "RunDirLock(sys.argv[1]).join(sys.argv[2]); print('joined', flush=True)\n"
            "time.sleep(120)\n",
            str(tmp_path),
            token,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert writer.stdout.readline().strip() == "joined"
        written = json.loads((tmp_path / LOCK_FILE).read_text())
        assert written["writer_pid"] == writer.pid and written["token"] == token
        owner.release()  # the owner is gone; its rank 0 still writes
        with pytest.raises(
            RunDirBusyError, match=f"rank 0 of an earlier run still writes here .pid {writer.pid}"
        ):
            RunDirLock(tmp_path).acquire(wait_for_writer_s=0.5)
        threading.Timer(0.5, writer.kill).start()  # it notices its launcher is gone
        start = time.monotonic()
        RunDirLock(tmp_path).acquire(wait_for_writer_s=30).release()
        assert time.monotonic() - start < 10
    finally:
        _end(writer)


def test_joining_with_another_runs_token_is_refused(tmp_path):
    proc, _ = _holder(tmp_path)
    try:
        with pytest.raises(RunDirBusyError, match="no longer holds the run directory"):
            RunDirLock(tmp_path).join("not-the-token")
    finally:
        _end(proc)


def test_looking_at_a_held_lock_from_its_own_process_keeps_it_held(tmp_path):
    # Closing any descriptor of the lock file drops every POSIX lock the process has on it: a
    # probe, a second writer refused, or read_earlier_lock in the holder must not open one.
    from nemo_moe_metrics.run_dir import read_earlier_lock

    with RunDirLock(tmp_path) as held:
        assert RunDirLock.probe(tmp_path).token == held.token
        assert read_earlier_lock(tmp_path).token == held.token
        with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()} on host"):
            RunDirLock(tmp_path).acquire()
        probe = "from nemo_moe_metrics.run_dir import RunDirLock; import sys; "
        probe += "print(RunDirLock.probe(sys.argv[1]).token)"
        seen = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True
        )
        assert seen.stdout.strip() == held.token, seen.stderr[-2000:]


def test_one_process_cannot_hold_a_directory_twice(tmp_path):
    with RunDirLock(tmp_path), pytest.raises(RunDirBusyError, match="already held by this process"):
        RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()  # released: free again


@pytest.fixture
def no_record_locks(monkeypatch):
    """A file system without working record locks (lockd missing): lockf fails with ENOLCK."""

    def lockf(fd, cmd, *args):
        if cmd & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "lockf", lockf)


def test_without_record_locks_a_live_holder_on_this_host_is_known_by_its_pid(
    tmp_path, no_record_locks
):
    # The holder is this test's child: alive, then killed; only the text and its pid tell.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holder = {
            "host": socket.gethostname(),
            "pid": proc.pid,
            "started": "2026-01-01T00:00:00+00:00",
            "command": "nemo-moe-metrics run r.yaml",
            "start_ticks": processes.start_ticks(proc.pid),
            "token": "t",
        }
        (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
        with pytest.raises(RunDirBusyError, match=f"pid {proc.pid} on host"):
            RunDirLock(tmp_path).acquire()
        proc.kill()
        proc.wait()
        lock = RunDirLock(tmp_path).acquire()
        assert "ended without releasing it" in lock.notes[0]
        lock.release()
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_on_another_host_is_alive_while_its_heartbeat_moves(tmp_path, monkeypatch):
    # Record locks that do not reach the other host (NFS mounted nolock): the heartbeat decides.
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.5)
    holder = {
        "host": "node-17",
        "pid": 4242,
        "started": "2026-01-01T00:00:00+00:00",
        "command": "torchrun -m nemo_moe_metrics.train",
        "token": "t",
    }
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps(holder))
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            os.utime(path)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(RunDirBusyError, match="pid 4242 on host node-17"):
            RunDirLock(tmp_path).acquire()
    finally:
        stop.set()
        beating.join()
    lock = RunDirLock(tmp_path).acquire()  # the beat stopped: stale
    assert any("took over" in n for n in lock.notes)
    lock.release()


def test_an_owner_touches_its_lock_file_every_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.1)
    with RunDirLock(tmp_path):
        path = tmp_path / LOCK_FILE
        os.utime(path, (1.0, 1.0))  # long ago
        deadline = time.monotonic() + 10
        while path.stat().st_mtime < 2.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 5


def test_probes_are_not_holders_to_each_other_nor_to_an_owner(tmp_path):
    # Every rank of a job may probe at once at its end (the Bridge test did): a probe that
    # took the owner byte exclusively, or kept it while it judged the holder, was seen as a
    # live holder by the others. Here one probe stays inside its judgement for 3 s.
    RunDirLock(tmp_path).acquire().release()
    slow_probe = (
        "import sys, time\n"
        "from nemo_moe_metrics.run_dir import RunDirLock\n"
        "def slow(self, holder):\n"
        "    print('judging', flush=True); time.sleep(3); return False\n"
        "RunDirLock._alive_elsewhere = slow\n"
        "print(RunDirLock.probe(sys.argv[1]), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", slow_probe, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "judging"
        assert RunDirLock.probe(tmp_path) is None
        with RunDirLock(tmp_path) as owner:  # not refused because someone looked
            assert RunDirLock.probe(tmp_path).token == owner.token
        assert proc.stdout.readline().strip() == "None"
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
