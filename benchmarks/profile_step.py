#!/usr/bin/env python
"""A profile of one benchmark step with every flag on: ``python benchmarks/profile_step.py``.

The step benchmark's megatron-core MoE model (``benchmarks.harness``) on one gloo rank, one
thread; after warm-up steps, one on-step runs under ``torch.profiler`` (the device ops, by
their own CPU time) and one under ``cProfile`` (the Python functions, cumulative CPU time of
the package's own code). Prints both tables; CPU time, so it is meaningful on a busy machine.

    python benchmarks/profile_step.py [--rows 25] [--routing]

``--routing`` also passes rollout routes to ``microbatch()`` (``track_routing_consistency``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

from benchmarks.harness import BenchConfig, StepBench, spawn_ranks  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Profile one step; print the device-op and Python tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    args = parser.parse_args(argv)
    (out,) = spawn_ranks(step_profile_rank, 1, BenchConfig(), args.rows, timeout=900.0)
    print(out["ops"])
    print(out["python"])
    return 0


def step_profile_rank(rank: int, world_size: int, cfg: BenchConfig, rows: int) -> dict[str, str]:
    """Warm up, then profile one on-step twice: device ops, then Python functions."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nemo_moe_metrics.config import MegatronConfig
    from nemo_moe_metrics.megatron.model import init_distributed

    torch.set_num_threads(cfg.threads)
    init_distributed(MegatronConfig(), seed=cfg.seed)
    bench = StepBench(cfg, rank, world_size)
    on, off = bench.variants["on"], bench.variants["off"]
    for _ in range(3):
        bench.step(off, bench.batches())
        bench.step(on, bench.batches())
    batches = bench.batches()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        bench.step(on, batches)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    python = python_profile(lambda: bench.step(on, bench.batches()), rows)
    bench.close()
    return {"ops": ops, "python": python}


def python_profile(fn: Any, rows: int) -> str:
    """``fn()`` under cProfile: the package's functions by cumulative time, as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(r"nemo_moe_metrics", rows)
    return text.getvalue()


if __name__ == "__main__":
    sys.exit(main())
