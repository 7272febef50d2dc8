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
