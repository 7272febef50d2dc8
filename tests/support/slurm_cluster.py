"""A throwaway Slurm cluster on this one host: munge, slurmctld and N slurmd daemons (as root).

Debian's ``slurm-wlm`` 22.05 is built with ``--enable-multiple-slurmd`` (``scontrol show
config`` says ``MULTIPLE_SLURMD = Yes``), so two node daemons (``-N n1``, ``-N n2``, each on its
own port) make a two-node cluster of one machine: a job on ``--nodes 2`` really runs one task
per node and rendezvous across them as on a cluster. Everything (munge key and socket, the
controller's state, the spool, logs, ``slurm.conf``) lives in one temporary directory; clients
find it through ``SLURM_CONF``. Used by ``tests/launch/test_slurm_job.py``; by hand (what
docs/en/slurm.md shows)::

    python tests/support/slurm_cluster.py start /tmp/slurm-demo   # prints the SLURM_CONF to export
    python tests/support/slurm_cluster.py stop /tmp/slurm-demo

The daemons run in the foreground as children of the starting process when used from Python
(``LocalSlurm`` stops them, and they end with that process if it is killed); ``start`` from
the shell detaches them and ``stop`` ends them by the pids it recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from nemo_moe_metrics.testing import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
PARTITION = "debug"
PIDS_FILE = "pids.json"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def ensure_installed(install: bool = True, timeout_s: float = 600) -> None:
    """Raise SlurmUnavailable unless Slurm and munge are installed (installing them as root)."""
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    what = f"{', '.join(missing)} missing (Debian: apt-get install {' '.join(PACKAGES)})"
    if not install:
        raise SlurmUnavailable(what)
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{what}; installing needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{what}; no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{what}; {' '.join(cmd)} took over {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise SlurmUnavailable(f"{what}; {' '.join(cmd[:2])} failed: {' | '.join(tail)}")
    still = [b for b in BINARIES if _which(b) is None]
    if still:
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {', '.join(still)} missing")


class LocalSlurm:
    """munged + slurmctld + ``nodes`` slurmd on this host, configured under ``root``."""

    def __init__(self, root: str | Path, nodes: int = 2, cpus: int | None = None) -> None:
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, recipes/slurm.py) needs to reach this cluster."""
        path = os.environ.get("PATH", "")
        if "/usr/sbin" not in path.split(os.pathsep):
            path = os.pathsep.join([path, "/usr/sbin"])
        return {"SLURM_CONF": str(self.conf), "PATH": path}

    def write_config(self) -> None:
        """The munge key and a one-partition ``slurm.conf`` (CPU only, no accounting)."""
        # Throwaway: an earlier cluster's jobs and name in the same directory are forgotten.
        for old in ("state", "spool"):
            shutil.rmtree(self.root / old, ignore_errors=True)
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its socket's directories traversable by all and its key private.
        (self.root / "munge-run").mkdir(exist_ok=True)
        for path in (self.root, self.root / "munge-run"):
            path.chmod(0o755)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            f"ClusterName=nmm{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge-run/munge.socket",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            # No cgroups, no accounting daemon: what a container or a CI machine allows.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=600",  # scontrol keeps a finished job's state for 10 minutes
            "KillWait=5",
            "InactiveLimit=0",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemons(self) -> list[list[str]]:
        r, conf = self.root, str(self.conf)
        munged = [
            _which("munged"),
            "--foreground",
            f"--socket={r}/munge-run/munge.socket",
            f"--key-file={r}/munge/munge.key",
            f"--log-file={r}/munge/munged.log",
            f"--pid-file={r}/munge-run/munged.pid",
            f"--seed-file={r}/munge/munged.seed",
        ]
        ctld = [_which("slurmctld"), "-D", "-f", conf]
        slurmds = [[_which("slurmd"), "-D", "-f", conf, "-N", node] for node in self.nodes]
        return [munged, ctld, *slurmds]

    def start(self, timeout_s: float = 60, detach: bool = False) -> None:
        """Start the daemons and wait until every node is idle; SlurmUnavailable if not."""
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster's daemons run as root (SlurmUser=root)")
        self.write_config()
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            for i, cmd in enumerate(self._daemons()):
                log = open(self.root / "log" / f"daemon{i}.out", "ab")  # noqa: SIM115
                self.procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                        preexec_fn=None if detach else _die_with_parent,
                    )
                )  # fmt: skip
                log.close()
                if i == 0:
                    self._wait_for_munge(timeout_s)
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        if detach:
            (self.root / PIDS_FILE).write_text(json.dumps([p.pid for p in self.procs]))

    def _wait_for_munge(self, timeout_s: float) -> None:
        sock = self.root / "munge-run" / "munge.socket"
        deadline = time.monotonic() + timeout_s
        while not sock.exists():
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                log = (self.root / "munge" / "munged.log").read_text(errors="replace")
                raise SlurmUnavailable(f"munged did not start: {log.strip()[-300:]}")
            time.sleep(0.1)

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as sinfo reports them (empty while the controller is not up)."""
        proc = subprocess.run(
            [_which("sinfo"), "-h", "-N", "-o", "%N %T"],
            capture_output=True, text=True, env={**os.environ, **self.env}, timeout=30,
        )  # fmt: skip
        if proc.returncode != 0:
            return {}
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{dead[0]} exited at start: {self._log_tail()}")
            states = self.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(
            f"nodes not idle after {timeout_s:.0f} s ({states}): {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        tails = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = [x for x in log.read_text(errors="replace").splitlines() if "error" in x]
            if lines:
                tails.append(f"{log.name}: {lines[-1]}")
        return "; ".join(tails) or "no error in the daemons' logs"

    def stop(self) -> None:
        """Cancel every job on this cluster, then end the daemons started here."""
        if any(p.poll() is None for p in self.procs):
            self.cancel_all()
        # Node daemons first, munge last: slurmd and slurmctld authenticate through it.
        for proc in reversed(self.procs):
            _end(proc.pid, proc)
        self.procs = []

    def cancel_all(self, timeout_s: float = 20) -> None:
        """scancel every job of the partition and wait until the controller lists none."""
        if not self.conf.exists():
            return
        subprocess.run(
            [_which("scancel") or "scancel", f"--partition={PARTITION}"],
            capture_output=True, env={**os.environ, **self.env}, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._jobs_left():
            time.sleep(0.5)

    def _jobs_left(self) -> bool:
        proc = subprocess.run(
            [_which("squeue") or "squeue", "-h", "-o", "%i"],
            capture_output=True, text=True, env={**os.environ, **self.env}, timeout=30,
        )  # fmt: skip
        return proc.returncode == 0 and bool(proc.stdout.strip())

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child: SIGTERM when the starting process dies (a test run killed by a timeout)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _end(pid: int, proc: subprocess.Popen | None = None, timeout_s: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc is not None:
        proc.wait(timeout=timeout_s)


def main(argv: list[str]) -> int:
    """``start DIR`` (detached daemons) or ``stop DIR`` (the daemons ``start`` recorded)."""
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python tests/support/slurm_cluster.py start|stop DIR", file=sys.stderr)
        return 2
    cluster = LocalSlurm(argv[1])
    if argv[0] == "start":
        try:
            cluster.start(detach=True)
        except SlurmUnavailable as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    pids_file = cluster.root / PIDS_FILE
    if not pids_file.is_file():
        print(f"error: {pids_file} not found: no cluster started there", file=sys.stderr)
        return 1
    cluster.cancel_all()
    for pid in reversed(json.loads(pids_file.read_text())):
        _end(pid)
    pids_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
