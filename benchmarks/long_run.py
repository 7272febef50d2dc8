#!/usr/bin/env python
"""Write a realistic long run directory for the report: ``python benchmarks/long_run.py OUT``.

    python benchmarks/long_run.py /tmp/run10k                      # 10,000 steps, 94 x 256
    python benchmarks/long_run.py /tmp/small --steps 200 --layers 8 --experts 16

What a 10,000-step run of a 94-layer, 256-expert, top-8 model writes (``metrics.jsonl``,
``expert_loads.bin`` through the store's own writer, ``run.json``), with loads that behave like
a real run's: each layer's router starts skewed and balances slowly under the aux loss, the
expert shares random-walk from step to step, a few experts die for a stretch (dead-expert
streaks), one layer collapses onto a few experts for a while (a routing-drift spike), and the
token counts carry multinomial-sized noise. The JSONL holds every scalar the worker logs with
per-layer logging on (about 1,000 keys a step), the store one table every ``--table-every``
steps (default: ``logger.table_every``'s default; 1 stores every step, the report's hardest case).
Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

from nemo_moe_metrics.config import DEFAULT_TABLE_EVERY  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.run_dir.names import RUN_FILE  # noqa: E402
from nemo_moe_metrics.run_dir.run_json import run_metadata  # noqa: E402
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink  # noqa: E402
from nemo_moe_metrics.sinks.store import ExpertLoadStore, store_path  # noqa: E402

TOPK = 8
TOKENS_PER_STEP = 1024 * 4096  # 1,024 sequences of 4,096 tokens
EP_SIZE = 8


def _layer_stats(counts: np.ndarray) -> dict[str, np.ndarray]:
    """The worker's per-layer statistics, vectorised over layers (same formulas as balance.py)."""
    c = counts.astype(np.float64)
    e = c.shape[1]
    total = c.sum(axis=1)
    mean = total / e
    p = c / total[:, None]
    logs = np.zeros_like(p)
    np.log2(p, out=logs, where=p > 0)
    ep = c.reshape(c.shape[0], EP_SIZE, -1).sum(axis=2)
    return {
        "max_over_ideal": c.max(axis=1) / mean,
        "min_over_ideal": c.min(axis=1) / mean,
        "coefficient_of_variation": c.std(axis=1) / mean,
        "normalized_entropy": -(p * logs).sum(axis=1) / np.log2(e),
        "zero_token_experts": (c == 0).sum(axis=1).astype(np.float64),
        "ep_imbalance": ep.max(axis=1) / ep.mean(axis=1),
        "dropped_fraction": np.zeros(c.shape[0]),
    }


def dead_streaks(steps: int, layers: int, experts: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(layer, expert) -> (first, last step) of the experts the generated run kills for a while
    (at 10,000 x 94 x 256: layer 3 expert 17 steps 1,000-4,000, layer 40 expert 199 from step
    2,500 to the end, layer 77 expert 5 steps 6,000-6,800)."""
    return {
        (min(3, layers - 1), 17 % experts): (steps // 10, 4 * steps // 10),
        (int(0.43 * layers), int(0.78 * experts)): (steps // 4, steps - 1),
        (int(0.82 * layers), 5 % experts): (6 * steps // 10, 68 * steps // 100),
    }


def collapse(steps: int, layers: int) -> tuple[int, tuple[int, int]]:
    """The layer whose router collapses onto experts 0-3, and the steps it stays collapsed."""
    return min(12, layers - 1), (steps // 2, steps // 2 + max(1, steps // 50))


def measure_report(run_dir: Path, out_dir: Path, timeout: float = 600.0) -> dict:
    """Run ``nemo-moe-metrics report RUN --out OUT`` in a fresh process: wall seconds, CPU
    seconds and peak RSS of that process alone (``getrusage`` of a wrapper's only child)."""
    import subprocess

    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': p.returncode, 'wall_s': wall, 'cpu_s': r.ru_utime + r.ru_stime,"
        " 'maxrss_kb': r.ru_maxrss, 'stdout': p.stdout, 'stderr': p.stderr[-3000:]}))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "report", str(run_dir), "--out"]
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *cmd, str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"report wrapper failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _report_checks(m: dict, out_dir: Path, steps: int, layers: int, experts: int, every: int):
    """The report's own checks on the generated run: exit 0, pictures, every step, the planted
    dead streak and collapse found."""
    summary = m["stdout"]
    (la, ex), (first, last) = next(iter(dead_streaks(steps, layers, experts).items()))
    first = -(-first // every) * every  # the first logged step of the streak
    last = last // every * every
    hot_layer, _ = collapse(steps, layers)
    pngs = ("expert_load_heatmap.png", "expert_load_over_steps.png", "routing_drift.png")
    return {
        "exit_0": m["rc"] == 0,
        "pictures_written": all((out_dir / f).is_file() for f in pngs),
        "reads_every_logged_step": f"steps 0–{steps - 1} ({steps} logged)" in summary,
        "finds_the_dead_streak": f"expert {ex} steps {first}–{last}" in summary
        and f"layer {la}:" in summary,
        "finds_the_collapse": f"at layer {hot_layer} step" in summary,
    }


def report_bench(
    work: Path,
    *,
    steps: int,
    layers: int,
    experts: int,
    table_every: int,
    every_step: bool = True,
) -> dict:
    """Generate a run, report on it at ``table_every`` and (``every_step``) on the same run with
    a table every step (the report's hardest case); the benchmark keys, checks and details."""
    run_dir, out_dir = Path(work) / "run", Path(work) / "report"
    every_dir, every_out = Path(work) / "run_every_step", Path(work) / "report_every_step"
    written = write_run(
        run_dir,
        steps=steps,
        layers=layers,
        experts=experts,
        table_every=table_every,
        also={every_dir: 1} if every_step else None,
    )
    m = measure_report(run_dir, out_dir)
    checks = {
        f"report_{k}": v
        for k, v in _report_checks(m, out_dir, steps, layers, experts, table_every).items()
    }
    result = {"report_seconds": m["wall_s"], "report_peak_rss_mb": m["maxrss_kb"] / 1024}
    details = {
        "steps": steps,
        "shape": [layers, experts],
        "table_every": table_every,
        "tables_in_store": len(range(0, steps, table_every)),
        "cpu_seconds": m["cpu_s"],
        "jsonl_mb": written["jsonl_bytes"] / 1e6,
        "store_mb": written["store_bytes"] / 1e6,
        "generate_seconds": written["seconds"],
        "stderr_tail": m["stderr"][-500:],
    }
    if every_step:
        e = measure_report(every_dir, every_out)
        checks.update(
            {
                f"report_every_step_{k}": v
                for k, v in _report_checks(e, every_out, steps, layers, experts, 1).items()
            }
        )
        result["report_seconds_every_step"] = e["wall_s"]
        result["report_peak_rss_mb_every_step"] = e["maxrss_kb"] / 1024
        details["every_step"] = {
            "tables_in_store": steps,
            "cpu_seconds": e["cpu_s"],
            "store_mb": written["store_bytes_every_1"] / 1e6,
            "stderr_tail": e["stderr"][-500:],
        }
    return {**result, "checks": checks, "details": details}


def tiled_report_bench(work: Path, repeats: int) -> dict:
    """Time the report over ``report_bench``'s every-step run tiled ``repeats`` times (10: a
    100,000-step run at 94 x 256 with a table every step, about 10 GB on disk while it lasts);
    the tiled run is deleted afterwards."""
    src, out_dir = Path(work) / "run_every_step", Path(work) / "report_tiled"
    run_dir = Path(work) / "run_tiled"
    try:
        written = tile_run(src, run_dir, repeats)
        m = measure_report(run_dir, out_dir, timeout=3600.0)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = repeats * len(
        [line for line in (src / METRICS_FILE).read_bytes().splitlines() if line.strip()]
    )
    pngs = ("expert_load_heatmap.png", "expert_load_over_steps.png", "routing_drift.png")
    return {
        "report_seconds": m["wall_s"],
        "report_peak_rss_mb": m["maxrss_kb"] / 1024,
        "cpu_seconds": m["cpu_s"],
        "steps": steps,
        "store_mb": written["store_bytes"] / 1e6,
        "jsonl_mb": written["jsonl_bytes"] / 1e6,
        "tile_seconds": written["seconds"],
        "stderr_tail": m["stderr"][-500:],
        "checks": {
            "report_tiled_exit_0": m["rc"] == 0,
            "report_tiled_pictures_written": all((out_dir / f).is_file() for f in pngs),
            "report_tiled_reads_every_logged_step": f"steps 0–{steps - 1} ({steps} logged)"
            in m["stdout"],
        },
    }


def write_run(
    out: Path,
    *,
    steps: int = 10_000,
    layers: int = 94,
    experts: int = 256,
    table_every: int = DEFAULT_TABLE_EVERY,
    seed: int = 0,
    also: dict[Path, int] | None = None,
) -> dict[str, float]:
    """Write the run directory ``out``; returns its size in bytes per file and seconds taken.

    ``also`` maps more run directories to their table cadence: each gets the same
    ``metrics.jsonl`` and ``run.json`` (hard links, or copies) and its own store at that cadence,
    written in the same pass (one generation serves the default cadence and every step).
    """
    if experts % EP_SIZE:
        raise ValueError(f"--experts must be a multiple of {EP_SIZE} (expert parallel size)")
    out = Path(out)
    cadences = {out: table_every, **{Path(k): v for k, v in (also or {}).items()}}
    for d in cadences:
        d.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, store_path(d).name, RUN_FILE):
            (d / name).unlink(missing_ok=True)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    config = {
        "policy": {"model": {"num_layers": layers, "num_experts": experts, "moe_router_topk": TOPK}}
    }
    (out / RUN_FILE).write_text(json.dumps(run_metadata("long_run_94x256", config), indent=2))

    logits = rng.normal(0.0, 0.6, (layers, experts))  # skewed start
    dead = dead_streaks(steps, layers, experts)
    collapse_layer, collapsed = collapse(steps, layers)
    wanted = TOKENS_PER_STEP * TOPK
    total_tokens = total_seconds = 0.0
    jsonl = JsonlSink(out / METRICS_FILE, fsync=False)
    stores = {d: (ExpertLoadStore(store_path(d), fsync=False), k) for d, k in cadences.items()}
    layer_ids = list(range(layers))
    try:
        for step in range(steps):
            # The aux loss pulls the routers towards balance; the shares wander meanwhile.
            logits *= 0.9995
            logits += rng.normal(0.0, 0.005, logits.shape)
            z = logits.copy()
            if collapsed[0] <= step < collapsed[1]:
                z[collapse_layer, :4] += 4.0
            for (la, ex), (a, b) in dead.items():
                if a <= step <= b:
                    z[la, ex] = -np.inf
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            mean = p * wanted
            counts = np.rint(mean + np.sqrt(mean) * rng.standard_normal(mean.shape))
            counts = np.maximum(counts, 0).astype(np.int64)
            stats = _layer_stats(counts)
            seconds = 9.5 + rng.normal(0, 0.2)
            total_tokens += TOKENS_PER_STEP
            total_seconds += seconds
            flops = 6 * 22e9 * TOKENS_PER_STEP
            lb = 1.0 + 0.05 * stats["coefficient_of_variation"]
            record: dict[str, float] = {
                mn.TRAIN_LOSS: 2.0 + 6.0 * np.exp(-step / 2_000) + rng.normal(0, 0.02),
                mn.TRAIN_NUM_MICROBATCHES: 64,
                mn.TRAIN_NUM_SEQUENCES: 1024,
                mn.aux_loss_key("load_balancing_loss"): float(lb.mean()),
                mn.aux_loss_key("z_loss"): 0.9 + rng.normal(0, 0.01),
                mn.MAX_OVER_IDEAL: float(stats["max_over_ideal"].mean()),
                mn.MAX_OVER_IDEAL_MAX: float(stats["max_over_ideal"].max()),
                mn.EP_IMBALANCE: float(stats["ep_imbalance"].mean()),
                mn.EP_IMBALANCE_MAX: float(stats["ep_imbalance"].max()),
                mn.DEAD_EXPERTS: float(stats["zero_token_experts"].sum()),
                mn.DROPPED_FRACTION: 0.0,
                mn.TOKENS: TOKENS_PER_STEP,
                mn.SECONDS: seconds,
                mn.TOKENS_PER_SECOND: TOKENS_PER_STEP / seconds,
                mn.TOTAL_TOKENS: total_tokens,
                mn.TOTAL_SECONDS: total_seconds,
                mn.CUMULATIVE_TOKENS_PER_SECOND: total_tokens / total_seconds,
                mn.ESTIMATED_FLOPS: flops,
                mn.ESTIMATED_FLOPS_PER_SECOND: flops / seconds,
                mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND: flops * (step + 1) / total_seconds,
                mn.TFLOPS_PER_GPU: flops / seconds / 256 / 1e12,
                mn.MFU: flops / seconds / 256 / 989e12,
            }
            for i in range(layers):
                record[mn.aux_loss_layer_key("load_balancing_loss", i)] = float(lb[i])
                record[mn.aux_loss_layer_key("z_loss", i)] = 0.9
                for name, values in stats.items():
                    record[mn.layer_stat_key(i, name)] = float(values[i])
            jsonl.log(record, step)
            for store, every in stores.values():
                if step % every == 0:
                    store.append(step, layer_ids, counts)
    finally:
        jsonl.close()
        for store, _ in stores.values():
            store.close()
    for d in cadences:
        if d != out:
            for name in (METRICS_FILE, RUN_FILE):
                try:
                    os.link(out / name, d / name)
                except OSError:
                    shutil.copyfile(out / name, d / name)
    return {
        "seconds": time.perf_counter() - started,
        "jsonl_bytes": (out / METRICS_FILE).stat().st_size,
        "store_bytes": store_path(out).stat().st_size,
        **{f"store_bytes_every_{k}": store_path(d).stat().st_size for d, k in cadences.items()},
    }


def tile_run(src: Path, out: Path, repeats: int) -> dict[str, float]:
    """Write ``out``: the run ``src`` (``write_run``'s) ``repeats`` times over, its steps shifted
    so that they continue (a 10,000-step run tiled 10 times is a 100,000-step run with the same
    per-step content): generating 100,000 steps afresh takes 10x longer than reading them.
    The JSONL lines keep their keys (only ``step`` changes); the store is written by its own
    writer. Returns the sizes and the seconds taken."""
    from nemo_moe_metrics.sinks.store import read_expert_load_blocks

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shutil.copyfile(Path(src) / RUN_FILE, out / RUN_FILE)
    lines = [line for line in (Path(src) / METRICS_FILE).read_bytes().splitlines() if line]
    steps = len(lines)
    prefix = b'{"step":'
    with (out / METRICS_FILE).open("wb") as f:
        for r in range(repeats):
            for i, line in enumerate(lines):
                f.write(b"%s%d%s\n" % (prefix, r * steps + i, line[line.index(b",") :]))
    (out / store_path(out).name).unlink(missing_ok=True)
    with ExpertLoadStore(store_path(out), fsync=False) as store:
        for r in range(repeats):
            for block_steps, ids, counts in read_expert_load_blocks(store_path(src), workers=2):
                for s, c in zip(block_steps, counts, strict=True):
                    store.append(int(s) + r * steps, ids, c)
    return {
        "seconds": time.perf_counter() - started,
        "jsonl_bytes": (out / METRICS_FILE).stat().st_size,
        "store_bytes": store_path(out).stat().st_size,
    }


def main(argv: list[str] | None = None) -> int:
    """Write the run directory and print its size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="run directory to write (files are replaced)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=94)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument(
        "--table-every",
        type=int,
        default=DEFAULT_TABLE_EVERY,
        help=f"store a table every N steps (default {DEFAULT_TABLE_EVERY}, as logger.table_every)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.steps, args.layers, args.experts, args.table_every) < 1:
        parser.error("--steps, --layers, --experts and --table-every must be >= 1")
    info = write_run(
        args.out,
        steps=args.steps,
        layers=args.layers,
        experts=args.experts,
        table_every=args.table_every,
        seed=args.seed,
    )
    print(
        f"{args.out}: {args.steps} steps, {args.layers} x {args.experts}; metrics.jsonl "
        f"{info['jsonl_bytes'] / 1e6:.0f} MB, store {info['store_bytes'] / 1e6:.0f} MB, "
        f"written in {info['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
