#!/usr/bin/env python
"""``nemo-moe-metrics placement`` over a long run: ``python benchmarks/placement_bench.py [RUN]``.

Times the command in its own process (wall seconds, as a user waits for it) on a run with a
table every step (10,000 steps at 94 x 256 in ``benchmarks/run.py``: every stored step is read
and summed), planning for 32 GPUs with 32 redundant experts and sweeping R = 0, 32, ..., 256,
then checks the plan: every layer, every expert placed, ``G`` equal GPUs, a sweep monotone in R.
Without RUN it generates the run first (``benchmarks/long_run.py``, a table every step).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

EP_SIZE = 32
REDUNDANT = 32


def placement_bench(run_dir: Path, out: Path, *, layers: int, experts: int) -> dict:
    """``{"placement_seconds": wall s, "checks": {...}, "details": {...}}`` for one run."""
    ep = min(EP_SIZE, experts)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "placement", str(run_dir)]
    cmd += ["--ep-size", str(ep), "--redundant-experts", str(ep), "--sweep", "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    checks = {"placement_exit_0": proc.returncode == 0}
    plan = json.loads(out.read_text()) if out.is_file() else {}
    rows = plan.get("physical_to_logical", [])
    checks["placement_every_layer"] = len(rows) == layers
    checks["placement_every_expert_placed"] = bool(rows) and all(
        len(r) == experts + ep and set(r) == set(range(experts)) for r in rows
    )
    sweep = [s["balancedness"] for s in plan.get("sweep", [])]
    pairs = zip(sweep, sweep[1:], strict=False)  # consecutive values of R
    checks["placement_sweep_monotone"] = bool(sweep) and all(
        b >= a for prev, cur in pairs for a, b in zip(prev, cur, strict=True)
    )
    details = {
        "cpu_seconds": cpu,  # the command's own work, without waiting for a core
        "load_average_1m": os.getloadavg()[0],
        "ep_size": ep,
        "redundant_experts": ep,
        "sweep_points": len(sweep),
        "balancedness_before_mean": _mean(plan.get("balancedness_before", [])),
        "balancedness_after_mean": _mean(plan.get("balancedness_after", [])),
        "stderr_tail": proc.stderr[-1000:] if proc.returncode else "",
    }
    return {"placement_seconds": wall, "checks": checks, "details": details}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> int:
    """Time ``placement`` on RUN (or on a generated 10,000-step run); print the result."""
    from benchmarks.long_run import write_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, nargs="?", help="a run directory (default: generate)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=94)
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nmm_placement_") as work:
        run = args.run
        if run is None:
            run = Path(work) / "run"
            write_run(run, steps=args.steps, layers=args.layers, experts=args.experts,
                      table_every=1)  # fmt: skip
        result = placement_bench(
            run, Path(work) / "PLAN.json", layers=args.layers, experts=args.experts
        )
    print(json.dumps(result, indent=2))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
