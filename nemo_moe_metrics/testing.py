"""Run a function on real multi-process torch.distributed (gloo) ranks, bounded by a timeout.

Shared by the tests (real multi-process collectives, never mocks) and the benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on the loopback interface, drawn at random below the kernel's ephemeral
    range.

    Not the port the kernel gives a bind to 0: that range is also where every outgoing
    connection gets its local port, and gloo opens many, so between this check and the
    rendezvous server's bind another test session's ranks could take it (CI saw EADDRINUSE
    with both Python lines' suites running at once).
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()  # never a test's seeded generator: two sessions, one sequence
    for _ in range(100):
        port = draw.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole range busy: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (Linux's default 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Imported once by the fork server, so that every rank starts with them loaded: importing
#: megatron-core costs ~9 s of CPU per process (it pulls in torch._inductor and wandb), which
#: dominated the multi-rank tests on a 2-core machine. Missing ones are skipped.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.pipeline_parallel",
    "nemo_moe_metrics.worker.policy_metrics",
    "nemo_moe_metrics.algorithms.megatron_policy",
)


def _context() -> mp.context.BaseContext:
    """A fork-server context whose server has imported :data:`_PRELOAD` (started on first use,
    shared by every later call in this process); ranks fork from it, clean of any test's state."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _child(fn, rank, world_size, port, args, results, env, threads):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads),
        **env,
    )
    import torch

    # OMP_NUM_THREADS is read when torch is imported, which the test module already did: one
    # intra-op thread per rank, or ranks oversubscribe the 2-core machine many times over.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as err:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    threads: int = 1,
) -> list[tuple[str, Any]]:
    """Start ``world_size`` processes (forked from a warm fork server) running
    ``fn(rank, world_size, *args)``.

    Returns ``[(status, value)]`` by rank, status "ok" (value = return value) or "error"
    (value = the exception text, or why its process ended without a result). Raises
    TimeoutError if a rank still running is not done in time. A rendezvous port another process
    took first (EADDRINUSE) is not the test's failure: the ranks start again on a new port.
    ``threads`` is each rank's intra-op thread count (1: ranks never oversubscribe the cores).
    """
    ctx = _context()
    for _ in range(_PORT_ATTEMPTS - 1):
        out = _run_once(ctx, fn, world_size, args, timeout, env or {}, threads)
        if not any(_port_taken(status, value) for status, value in out):
            return out
    return _run_once(ctx, fn, world_size, args, timeout, env or {}, threads)


#: Rendezvous tries, each on a new port, when another process took the port first.
_PORT_ATTEMPTS = 3


def _port_taken(status: str, value: Any) -> bool:
    return status == "error" and "EADDRINUSE" in str(value)


def _run_once(ctx, fn, world_size, args, timeout, env, threads) -> list[tuple[str, Any]]:
    """One start of the ranks on a fresh port; stops them all at once if the port was taken."""
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, args, results, env, threads),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
                out[rank] = (status, value)
                if _port_taken(status, value):
                    # The other ranks would wait on a store that is not ours until their
                    # timeout, or meet a stranger's: stop them, the caller starts afresh.
                    for p in procs:
                        p.kill()
                    for r in range(world_size):
                        out.setdefault(r, ("error", "stopped: the rendezvous port was taken"))
                continue
            except queue.Empty:
                pass
            # A rank whose process is gone without a result (killed, or it could not start)
            # fails now, not at the timeout; its result may still be in the pipe: drain first.
            gone = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if gone:
                while True:
                    try:
                        rank, status, value = results.get(timeout=0.5)
                    except queue.Empty:
                        break
                    out[rank] = (status, value)
                for r in gone:
                    out.setdefault(
                        r,
                        (
                            "error",
                            f"the rank's process exited (code {procs[r].exitcode}) "
                            "without returning a result",
                        ),
                    )
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in "
                    f"{timeout}s"
                )
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def ok_values(results: list[tuple[str, Any]]) -> list[Any]:
    """The return values of all ranks; raises with every rank's error text if any rank failed."""
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(results) if s != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [v for _, v in results]


#: The Megatron-Bridge release whose callbacks module the tests and the example load.
BRIDGE_VERSION = "0.6.2"
_BRIDGE_CALLBACKS = "megatron/bridge/training/callbacks.py"


def bridge_cache_dir() -> Path:
    """Where the Megatron-Bridge wheel and its unpacked callbacks module are cached."""
    root = os.environ.get("NEMO_MOE_METRICS_CACHE") or Path.home() / ".cache" / "nemo_moe_metrics"
    return Path(root)


def load_bridge_callbacks(version: str = BRIDGE_VERSION, cache: Path | None = None) -> Any:
    """Megatron-Bridge's ``training/callbacks.py`` from its wheel, loaded alone by file path.

    The full Bridge package does not install or run on a CPU machine (see docs/en/frameworks.md),
    but its callbacks module imports only the standard library. The wheel is fetched from the
    package registry once (``pip download megatron-bridge==VERSION --no-deps``) into the cache
    (:func:`bridge_cache_dir`), the one file is unpacked there, and the module is registered as
    ``megatron.bridge.training.callbacks`` so ``nemo_moe_metrics.integrations.megatron_bridge``
    finds it as it would find the installed package. Returns the module.
    """
    import importlib.util
    import shutil
    import subprocess
    import sys
    import tempfile
    import zipfile

    name = "megatron.bridge.training.callbacks"
    if name in sys.modules:
        return sys.modules[name]
    cache = Path(cache) if cache is not None else bridge_cache_dir()
    path = cache / f"megatron_bridge-{version}" / _BRIDGE_CALLBACKS
    if not path.is_file():
        wheels = cache / "wheels"
        wheel = wheels / f"megatron_bridge-{version}-py3-none-any.whl"
        if not wheel.is_file():
            # Into a private folder first: a second test session (CI runs both Python lines at
            # once) must never read a half-written wheel.
            wheels.mkdir(parents=True, exist_ok=True)
            private = Path(tempfile.mkdtemp(dir=wheels))
            cmd = [sys.executable, "-m", "pip", "download", f"megatron-bridge=={version}"]
            cmd += ["--no-deps", "--python-version", "3.12", "--only-binary=:all:"]
            cmd += ["-d", str(private), "--quiet"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                fetched = private / wheel.name
                if proc.returncode != 0 or not fetched.is_file():
                    raise RuntimeError(
                        f"could not fetch the megatron-bridge {version} wheel ({' '.join(cmd)}): "
                        f"{proc.stderr.strip()[-2000:]}"
                    )
                os.replace(fetched, wheel)
            finally:
                shutil.rmtree(private, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(_BRIDGE_CALLBACKS)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
