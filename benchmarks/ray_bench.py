#!/usr/bin/env python
"""The Ray engine's cost, measured in one run: ``python benchmarks/ray_bench.py [--steps N]``.

- ``ray_step_ratio``: the step time of the Ray path (a driver over 2 Ray actors on an embedded
  local Ray) over the torchrun path's (2 torchrun ranks), on the quick recipe
  (``examples/configs/grpo_moe_tiny.yaml``, every flag on): the median time between two logged
  steps as the process that logs sees it (the driver; rank 0), warm-up steps left out. Both
  run the same loop body and worker with one intra-op thread per rank and no sinks (logging
  costs the same on rank 0 and on the driver; ``table_step_host_ms_94x256`` measures it).
  The two paths run one after the other, torchrun first, then Ray, then torchrun again (the
  torchrun time is the mean of its two runs, so a load change during the run weighs on both).
- ``ray_table_transfer_ms_94x256``: moving one 94 x 256 expert table from an actor to the
  driver: the median round trip of a call that returns rank 0's ``WorkerResult`` with the
  table (its three arrays), on the same embedded Ray; ``details.no_op_call_ms``: the same
  call returning nothing, for comparison.

``benchmarks/run.py`` adds both to its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

RECIPE = _REPO / "examples" / "configs" / "grpo_moe_tiny.yaml"
WARMUP = 2  # steps left out: the first steps build caches and warm the allocator


def _recipe(steps: int) -> Any:
    from nemo_moe_metrics.config import load_recipe

    return load_recipe(RECIPE, [f"training.max_steps={steps}"])


def _intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :], strict=False)]


def spmd_rank(steps: int, out: str) -> None:
    """One torchrun rank: the worker and the loop as ``nemo_moe_metrics.train`` runs them,
    without sinks; rank 0 writes the times it logged each step."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from nemo_moe_metrics.algorithms import run_algorithm
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.launch.recipe_run import make_metrics

    recipe = _recipe(steps)
    worker = MegatronPolicyWorker(recipe, metrics=make_metrics(recipe))
    times: list[float] = []
    run_algorithm(recipe, worker, lambda metrics, step: times.append(time.perf_counter()))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def torchrun_times(steps: int, timeout_s: float = 600) -> list[float]:
    """The logged-step times of one 2-rank torchrun job (rank 0's clock)."""
    from nemo_moe_metrics.testing import free_port

    with tempfile.TemporaryDirectory(prefix="nmm_ray_bench_") as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), __file__, "--spmd-rank", "--steps", str(steps),
               "--out", str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"the torchrun job failed: {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


class TableActor:
    """An actor holding rank 0's result of a 94 x 256 table step, as a worker returns it."""

    def __init__(self, layers: int, experts: int) -> None:
        import numpy as np

        from nemo_moe_metrics.export.expert_table import ExpertTable
        from nemo_moe_metrics.worker.results import worker_result

        counts = np.random.default_rng(0).integers(0, 10_000, (layers, experts))
        metrics = {"moe/expert_loads": ExpertTable(np.arange(layers), counts)}
        metrics.update({f"moe/scalar_{i}": float(i) for i in range(100)})
        self.result = worker_result(metrics, step=0, rank=0, node="bench")

    def table_step(self) -> Any:
        """Rank 0's result of a table step."""
        return self.result

    def nothing(self) -> None:
        """A call that returns nothing (the round trip alone)."""


def ray_measure(steps: int, transfers: int, layers: int = 94, experts: int = 256) -> dict:
    """On one embedded Ray: the driver's logged-step times over 2 actors, then the transfer of
    a ``layers`` x ``experts`` table from an actor, ``transfers`` times."""
    import ray

    from nemo_moe_metrics.algorithms import run_algorithm
    from nemo_moe_metrics.launch.ray_cluster import connect, place, plan_placement
    from nemo_moe_metrics.launch.ray_driver import actor_env
    from nemo_moe_metrics.launch.ray_group import RayWorkerGroup

    recipe = _recipe(steps)
    session = connect(None)
    try:
        placement = place(plan_placement(2, session.address), 300)
        group = RayWorkerGroup(recipe, placement, env=actor_env())
        times: list[float] = []
        try:
            run_algorithm(recipe, group, lambda metrics, step: times.append(time.perf_counter()))
        finally:
            group.kill()
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get(
            "PYTHONPATH")]))}  # fmt: skip
        actor = ray.remote(num_cpus=0)(TableActor).options(runtime_env={"env_vars": env})
        holder = actor.remote(layers, experts)
        ray.get(holder.nothing.remote())
        table_ms, noop_ms = [], []
        for _ in range(transfers):
            start = time.perf_counter()
            result = ray.get(holder.table_step.remote())
            table_ms.append(1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            ray.get(holder.nothing.remote())
            noop_ms.append(1e3 * (time.perf_counter() - start))
        table = result.metrics["moe/expert_loads"]
        assert table.counts.shape == (layers, experts) and table._rows is None  # arrays only
        ray.kill(holder)
    finally:
        session.shutdown()
    return {"times": times, "table_ms": table_ms, "noop_ms": noop_ms}


def ray_bench(steps: int = 10, transfers: int = 50, bracket: bool = True) -> dict[str, Any]:
    """Both keys and their details (see the module docstring); ``bracket``: a torchrun run
    before and after the Ray run (False: before only, as ``--smoke`` does)."""
    runs = [torchrun_times(steps)]
    ray_run = ray_measure(steps, transfers)
    if bracket:
        runs.append(torchrun_times(steps))
    each = [statistics.median(_intervals(times)) for times in runs]
    torchrun_step = statistics.mean(each)
    ray_step = statistics.median(_intervals(ray_run["times"]))
    table_ms = statistics.median(ray_run["table_ms"])
    return {
        "ray_step_ratio": ray_step / torchrun_step,
        "ray_table_transfer_ms_94x256": table_ms,
        "details": {
            "recipe": str(RECIPE.relative_to(_REPO)),
            "steps": steps,
            "warmup_steps": WARMUP,
            "ray_step_ms_median": 1e3 * ray_step,
            "torchrun_step_ms_median": 1e3 * torchrun_step,
            "torchrun_step_ms_each_run": [1e3 * t for t in each],
            "transfers": transfers,
            "table_ms_min_max": [min(ray_run["table_ms"]), max(ray_run["table_ms"])],
            "no_op_call_ms": statistics.median(ray_run["noop_ms"]),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Print (and with ``--json`` write) the two keys; ``--spmd-rank``: one torchrun rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--transfers", type=int, default=50)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--spmd-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.spmd_rank:
        spmd_rank(args.steps, args.out)
        return 0
    result = ray_bench(args.steps, args.transfers)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
