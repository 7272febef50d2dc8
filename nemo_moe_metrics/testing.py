"""Run a function on real multi-process torch.distributed (gloo) ranks, bounded by a timeout.

Shared by the tests (real multi-process collectives, never mocks) and the benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``.

    Returns ``[(status, value)]`` by rank, status "ok" (value = return value) or "error"
    (value = the exception text). Raises TimeoutError if any rank is not done in time.
    ``threads`` is each rank's intra-op thread count (1: ranks never oversubscribe the cores).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, args, results, env or {}, threads),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    try:
        while len(out) < world_size:
            rank, status, value = results.get(timeout=timeout)
            out[rank] = (status, value)
    except queue.Empty:
        raise TimeoutError(
            f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout}s"
        ) from None
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
