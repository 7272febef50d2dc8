"""The multi-process helper every distributed test uses: it fails fast and starts ranks warm."""

from __future__ import annotations

import importlib.util
import os
import time

from dist import run_ranks

from nemo_moe_metrics import testing


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no exception, no result: as when the OOM killer takes a rank
    return rank * 10


def test_a_rank_that_dies_without_a_result_fails_at_once_not_at_the_timeout():
    start = time.monotonic()
    results = run_ranks(_die_on_rank_1, 2, timeout=300)
    assert results[0] == ("ok", 0)
    status, text = results[1]
    assert status == "error" and "exited (code 3) without returning a result" in text
    assert time.monotonic() - start < 60


def test_every_module_the_fork_server_preloads_exists():
    # A misspelt name is skipped silently by multiprocessing: each rank would import it again.
    for name in testing._PRELOAD:
        assert importlib.util.find_spec(name) is not None, name


def _all_reduce_rank_sum(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return float(total)


def test_a_rendezvous_port_taken_by_another_process_starts_the_ranks_again(monkeypatch):
    # CI once lost a test this way: two suites at once, and between choosing the port and
    # binding it, another process took it (EADDRINUSE).
    import socket

    draws = []
    real = testing.free_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]

        def first_the_taken_port() -> int:
            draws.append(taken if not draws else real())
            return draws[-1]

        monkeypatch.setattr(testing, "free_port", first_the_taken_port)
        start = time.monotonic()
        results = run_ranks(_all_reduce_rank_sum, 2, timeout=120)
    assert results == [("ok", 1.0), ("ok", 1.0)]
    assert len(draws) == 2 and draws[0] == taken and draws[1] != taken
    assert time.monotonic() - start < 60  # rank 1 did not wait out its timeout on the taken port


def test_free_port_draws_below_the_kernels_ephemeral_range():
    # The kernel gives outgoing connections (gloo opens many) their local ports from that
    # range, so a port drawn there can be taken before the rendezvous binds it.
    low = testing._ephemeral_low()
    ports = {testing.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports)
    assert len(ports) > 1  # drawn at random, not one fixed port every session shares
