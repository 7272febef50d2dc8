"""A throwaway multi-node Ray cluster on this one host, and the processes a Ray run leaves.

:class:`LocalRayCluster` runs ``ray start --head --block`` and ``ray start --address ...
--block`` once per extra node, each its own raylet with its own CPUs, as a Slurm job's nodes
would (NeMo RL's ``ray.sub``); clients find it through ``RAY_ADDRESS`` in :attr:`env`. The
cluster is token-protected with a token that lives only in that environment (nothing is
written to the home directory), and stopped by SIGTERM to each ``ray start`` process, which
stops its node's processes. ``ray`` is never imported into the test process.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_moe_metrics.launch.ray_slurm import active_nodes
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.testing import free_port

RAY = str(Path(sys.executable).parent / "ray")
#: The Ray processes of a node, by /proc comm name (workers are "ray::<Class>...").
RAY_PROCESS_NAMES = ("raylet", "gcs_server")


def ray_port() -> int:
    """A free port outside the ports Ray takes by default on a node (its workers' 10002-19999,
    the client server's 10001): for a head's GCS or a node's agent."""
    while True:
        port = int(free_port())
        if not 10000 <= port <= 19999:
            return port


def ray_env(token: str | None = None) -> dict[str, str]:
    """The environment of a token-protected Ray cluster and its clients."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token or secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


class LocalRayCluster:
    """A head node and ``nodes - 1`` worker nodes on this host, ``cpus`` CPUs each."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 1) -> None:
        self.root = Path(root)
        self.nodes, self.cpus = nodes, cpus
        self.port = ray_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.env = {**ray_env(), "RAY_ADDRESS": self.address}

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        self.procs.append(
            subprocess.Popen(
                [RAY, "start", *args, f"--num-cpus={self.cpus}", "--num-gpus=0", "--block",
                 "--disable-usage-stats"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True,
            )
        )  # fmt: skip
        log.close()

    def start(self, timeout_s: float = 300) -> LocalRayCluster:
        """Start the head, wait for it, then the other nodes, and wait until all are alive
        (the worker nodes join a head whose GCS answers, as a Slurm job's do)."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            # Ports of its own for every listener Ray would give a fixed default (10001,
            # 52365): two nodes on one host, and other Ray clusters on it, must not collide.
            head = ["--head", f"--port={self.port}", "--include-dashboard=false",
                    f"--ray-client-server-port={ray_port()}"]  # fmt: skip
            self._start([*head, f"--dashboard-agent-listen-port={ray_port()}"], "head")
            self.wait_nodes(1, timeout_s)
            for i in range(1, self.nodes):
                agent = f"--dashboard-agent-listen-port={ray_port()}"
                self._start([f"--address={self.address}", agent], f"node{i}")
            self.wait_nodes(self.nodes, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_nodes(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` nodes are alive (``ray status``, as the Slurm job waits)."""
        deadline = time.monotonic() + timeout_s
        said = ""
        while time.monotonic() < deadline:
            dead = [p.args for p in self.procs if p.poll() is not None]
            assert not dead, f"ray start ended: {dead}; logs in {self.root}"
            alive, said = active_nodes(self.address, env={**os.environ, **self.env})
            if alive >= count:
                return
            time.sleep(0.5)
        raise AssertionError(f"{count} Ray nodes not up after {timeout_s} s: {said}")

    def pids(self) -> list[int]:
        """Every process of the cluster (the ``ray start`` processes and what they started)."""
        found = []
        for proc in self.procs:
            found += [proc.pid, *processes.descendants(proc.pid)]
        return found

    def stop(self) -> None:
        """SIGTERM each ``ray start`` (it stops its node), workers before the head."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                processes.stop_descendants(proc.pid, grace_s=2)
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []


def named(pids: list[int]) -> dict[int, tuple[int | None, str]]:
    """``{pid: (start ticks, comm name)}`` of the pids that run now (a process-list snapshot)."""
    out = {}
    for pid in pids:
        ticks = processes.start_ticks(pid)
        if ticks is None:
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                out[pid] = (ticks, f.read().strip())
        except OSError:
            continue
    return out


def still_running(snapshot: dict[int, tuple[int | None, str]]) -> list[str]:
    """The processes of a :func:`named` snapshot that still run (the same process, by start
    time), as ``"pid name"``."""
    return [
        f"{pid} {name}"
        for pid, (ticks, name) in snapshot.items()
        if processes.is_alive(pid, ticks) and processes.proc_state(pid) != "Z"
    ]
