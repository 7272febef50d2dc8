#!/usr/bin/env python
"""The cost of observing, measured as ratios in one run: ``python benchmarks/run.py [--quick]``.

    python benchmarks/run.py --quick --json results.json     # about 5 minutes on 2 cores
    python benchmarks/run.py --json results.json             # more repeats
    python benchmarks/run.py --smoke                         # tiny sizes: checks the harness

Measures (JSON keys, targets):

- ``step_overhead_ratio`` (<= 1.01): median over interleaved pairs of (step with every metric on)
  / (step with every metric off: expert loads, aux losses, per-layer keys, the expert table,
  expert bias, router health, routing consistency with rollout routes, throughput and FLOPs), a
  megatron-core MoE GPTModel trained by megatron's schedule on one gloo rank with one thread;
  ``details.step.family_cpu_ms_per_step`` gives the metrics' own CPU time per step by metric family
  (``nemo_moe_metrics.families``: expert loads with the collector's hooks, aux losses, expert bias,
  router health, throughput and FLOPs);
- ``export_ms_40x256`` (<= 20): reduce + normalise + expert table, 40 layers x 256 experts,
  2 gloo ranks, median ms (slower rank) after the first export;
- ``flops_estimate_ms_4096`` (<= 2): FLOP estimate of 4,096 mixed-length sequences, the slower of
  qwen3_moe and qwen3_5_moe; ``flops_vectorised_speedup`` (>= 50): the smaller speedup over
  calling the estimator once per sequence;
- ``syncs_per_microbatch`` (0) and ``syncs_per_export`` (1): host reads of tensor data that the
  metrics add (on minus off), counted, not timed (``benchmarks/host_reads.py``);
- ``report_seconds_10k_94x256`` (<= 15) and ``report_peak_rss_mb_10k_94x256`` (<= 2048):
  wall seconds and peak RSS of ``nemo-moe-metrics report`` in its own process over a generated
  10,000-step run at 94 x 256 (``benchmarks/long_run.py``, default table cadence);
  ``report_seconds_10k_94x256_every_step`` (<= 15) and
  ``report_peak_rss_mb_10k_94x256_every_step`` (<= 2048): the same run with a table every step
  (``logger.table_every: 1``, 10,000 tables), the report's hardest case.
- ``store_bytes_per_step_94x256`` (<= 100,000), ``store_write_ms_94x256`` (<= 5) and
  ``wandb_table_ms_94x256`` (<= 100): the expert table of 94 MoE layers x 256 experts in the
  expert-load store (bytes on disk, ms to write) and in W&B offline (ms of host time), per step,
  amortised at the default ``logger.table_every`` (``benchmarks/store_bench.py``; the
  per-table-step figures are in ``details.store``); ``wandb_table_ms_94x256_loaded`` (<= 100):
  the same W&B figure while one busy-loop process per logical CPU keeps every core busy
  (``details.store.wandb_loaded`` says how many).
- ``store_bytes_per_table_step_94x256`` (<= 32,768) and ``store_write_ms_per_table_step_94x256``
  (<= 5): one 94 x 256 table in the store, bytes and ms to write (``details.store``);
- ``report_seconds_100k_94x256_every_step`` (<= 60) and
  ``report_peak_rss_mb_100k_94x256_every_step`` (<= 2048), with ``--slow`` (``--smoke`` at tiny
  sizes): the report over the every-step run above tiled 10 times, 100,000 steps
  (``benchmarks/long_run.py tiled_report_bench``; about 10 GB in the temporary folder and 10
  minutes more).
- ``routing_overhead_ratio`` (<= 1.005): median over interleaved pairs of (step with
  ``track_routing_consistency`` and rollout routes) / (the same step, every other MoE metric
  on, without it) (``benchmarks/routing_bench.py``); ``details.routing`` also holds the device
  memory of one microbatch's routes at 94 MoE layers x top-8 x 32k tokens (computed: 188 MiB).
- ``router_health_overhead_ratio`` (<= 1.005): the same interleaved pairs for
  ``track_router_health`` on / off (every other MoE metric on in both), and
  ``router_health_syncs_per_microbatch`` (0): host reads it adds per microbatch. The step
  benchmark's "every metric on" includes it, so ``step_overhead_ratio`` covers it too.
- ``table_step_host_ms_94x256`` (<= 3): the host CPU time a 94 x 256 expert-table step adds,
  from the one host read's reduced counts to the sinks: the table value of
  ``expert_load_metrics``, the alert monitor, validation, the JSONL file and the expert-load
  store (write and fsync call); W&B has its own key (``benchmarks/table_bench.py``).
- ``trl_callback_overhead_ratio`` (<= 1.02): a TRL ``SFTTrainer`` step with
  ``MoEMetricsCallback`` and every flag on over the same step without it, a model whose step
  takes at least 100 ms on one CPU thread, at TRL's default ``logging_steps`` (10: an export
  every 10th step; ``benchmarks/trl_bench.py``; ``details.trl.callback_cpu_ms_per_step``: the
  callback's own CPU time, events and hooks; ``details.trl.log_step_ratio``: a step that
  exports, with over without, the cost of every step at ``logging_steps=1``);
  absent when TRL is not installed.
- ``attach_seconds_94_layers`` (<= 1): ``PolicyMetrics.attach`` with every MoE flag, FLOPs and
  router health on a 94-layer x 128-expert transformers model without a registered FLOP formula
  (GLM-4.5's family, built on the meta device: the estimate is read from its modules),
  median seconds (``benchmarks/attach_bench.py``).
- ``placement_seconds_10k_94x256`` (<= 10): wall seconds of ``nemo-moe-metrics placement
  --ep-size 32 --redundant-experts 32 --sweep --out PLAN.json`` in its own process over the
  report's 10,000-step run with a table every step (every step read; the sweep R = 0, 32, ...,
  256), the plan checked (``benchmarks/placement_bench.py``).
- ``html_report_mb_10k_94x256`` (<= 8) and ``html_first_chart_s`` (<= 3): ``nemo-moe-metrics
  report --html`` over the same every-step run: the page's size (MB, 1e6 bytes) and, in
  headless Chromium (Debian's ``chromium``, network off), the seconds from the start of the
  page's navigation to its first chart drawn, median over a few loads
  (``benchmarks/html_bench.py``); absent without Chromium (``details.html`` says so).

- ``ray_step_ratio`` (<= 1.05): the step time of ``--engine ray`` (a driver over 2 Ray actors,
  an embedded local Ray) over the torchrun path's (2 ranks) on the quick recipe
  (``grpo_moe_tiny``), the median time between logged steps, torchrun measured before and
  after; ``ray_table_transfer_ms_94x256`` (<= 5): one 94 x 256 expert table from an actor to
  the driver, median round trip (``benchmarks/ray_bench.py``, ``details.ray``).

Exits 1 if a correctness check of the measured path fails (the numbers would mean nothing);
missed targets are reported, not fatal. Method and results: docs/en/performance.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# Measure the checkout this script sits in, not whichever copy happens to be installed.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))

from benchmarks.attach_bench import attach_bench  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    BenchConfig,
    StepModel,
    export_rank,
    flops_bench,
    spawn_ranks,
    step_rank,
)
from benchmarks.html_bench import html_bench  # noqa: E402
from benchmarks.long_run import report_bench, tiled_report_bench  # noqa: E402
from benchmarks.placement_bench import placement_bench  # noqa: E402
from benchmarks.ray_bench import ray_bench  # noqa: E402
from benchmarks.routing_bench import router_health_bench, routing_bench  # noqa: E402
from benchmarks.store_bench import store_bench  # noqa: E402
from benchmarks.table_bench import table_step_bench  # noqa: E402
from benchmarks.trl_bench import trl_bench  # noqa: E402
from nemo_moe_metrics.config import DEFAULT_TABLE_EVERY, LoggerConfig  # noqa: E402

RESULT_KEYS = (
    "step_overhead_ratio",
    "export_ms_40x256",
    "flops_estimate_ms_4096",
    "flops_vectorised_speedup",
    "syncs_per_microbatch",
    "syncs_per_export",
    "report_seconds_10k_94x256",
    "report_peak_rss_mb_10k_94x256",
    "report_seconds_10k_94x256_every_step",
    "report_peak_rss_mb_10k_94x256_every_step",
    "store_bytes_per_step_94x256",
    "store_write_ms_94x256",
    "wandb_table_ms_94x256",
    "wandb_table_ms_94x256_loaded",
    "routing_overhead_ratio",
    "router_health_overhead_ratio",
    "router_health_syncs_per_microbatch",
    "store_bytes_per_table_step_94x256",
    "store_write_ms_per_table_step_94x256",
    "report_seconds_100k_94x256_every_step",
    "report_peak_rss_mb_100k_94x256_every_step",
    "attach_seconds_94_layers",
    "table_step_host_ms_94x256",
    "placement_seconds_10k_94x256",
    "html_report_mb_10k_94x256",
    "html_first_chart_s",
    "trl_callback_overhead_ratio",
    "ray_step_ratio",
    "ray_table_transfer_ms_94x256",
)
#: Keys measured only where a browser runs (Chromium); absent elsewhere, never made up.
BROWSER_KEYS = ("html_first_chart_s",)
#: Keys --smoke leaves out (their launches cost more than the smoke test's whole budget).
NOT_IN_SMOKE = ("ray_step_ratio", "ray_table_transfer_ms_94x256")
TARGETS: dict[str, tuple[str, float]] = {
    "step_overhead_ratio": ("<=", 1.01),
    "export_ms_40x256": ("<=", 20.0),
    "flops_estimate_ms_4096": ("<=", 2.0),
    "flops_vectorised_speedup": (">=", 50.0),
    "syncs_per_microbatch": ("==", 0),
    "syncs_per_export": ("==", 1),
    "report_seconds_10k_94x256": ("<=", 15.0),
    "report_peak_rss_mb_10k_94x256": ("<=", 2048.0),
    "report_seconds_10k_94x256_every_step": ("<=", 15.0),
    "report_peak_rss_mb_10k_94x256_every_step": ("<=", 2048.0),
    "store_bytes_per_step_94x256": ("<=", 100_000.0),
    "store_write_ms_94x256": ("<=", 5.0),
    "wandb_table_ms_94x256": ("<=", 100.0),
    "wandb_table_ms_94x256_loaded": ("<=", 100.0),
    "routing_overhead_ratio": ("<=", 1.005),
    "router_health_overhead_ratio": ("<=", 1.005),
    "router_health_syncs_per_microbatch": ("==", 0),
    "store_bytes_per_table_step_94x256": ("<=", 32_768.0),
    "store_write_ms_per_table_step_94x256": ("<=", 5.0),
    "report_seconds_100k_94x256_every_step": ("<=", 60.0),
    "report_peak_rss_mb_100k_94x256_every_step": ("<=", 2048.0),
    "attach_seconds_94_layers": ("<=", 1.0),
    "table_step_host_ms_94x256": ("<=", 3.0),
    "placement_seconds_10k_94x256": ("<=", 10.0),
    "html_report_mb_10k_94x256": ("<=", 8.0),
    "html_first_chart_s": ("<=", 3.0),
    "trl_callback_overhead_ratio": ("<=", 1.02),
    "ray_step_ratio": ("<=", 1.05),
    "ray_table_transfer_ms_94x256": ("<=", 5.0),
}
FLOPS_FIXTURES = {"qwen3_moe": "qwen3-30b-a3b", "qwen3_5_moe": "qwen3.5-35b-a3b"}
STEP_WORLD_SIZE = 1  # one rank, one thread: the other core absorbs the machine's other load
EXPORT_WORLD_SIZE = 2

# The generated run the report is timed on: 10,000 steps at 94 x 256, default table cadence.
REPORT_RUN = dict(steps=10_000, layers=94, experts=256, table_every=DEFAULT_TABLE_EVERY)

PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        bench=BenchConfig(warmup_pairs=2, pairs=80, export_repeats=100),
        flops_repeats=200,
        loop_repeats=5,
        report=REPORT_RUN,
        store_repeats=100,
        wandb_repeats=5,
        routing_pairs=40,
        health_pairs=40,
        attach_layers=94,
        trl=dict(blocks=24, windows_per_block=1),
        ray=dict(steps=16, transfers=100),
        html_loads=5,
    ),
    "quick": dict(
        bench=BenchConfig(warmup_pairs=1, pairs=40, export_repeats=30),
        flops_repeats=50,
        loop_repeats=3,
        report=REPORT_RUN,
        store_repeats=30,
        wandb_repeats=3,
        # 40, as the full preset: over 20 pairs the median swung by more than the half-percent
        # targets between runs while the flags' own code stayed under 0.3 % of the step
        routing_pairs=40,
        health_pairs=40,
        attach_layers=94,
        trl=dict(blocks=16, windows_per_block=1),
        ray=dict(steps=10, transfers=50),
        html_loads=3,
    ),
    # Tiny model and few repeats: exercises every path in seconds; the numbers mean little.
    "smoke": dict(
        bench=BenchConfig(
            step=StepModel(
                num_layers=2,
                hidden_size=64,
                num_experts=8,
                topk=2,
                moe_ffn_hidden_size=64,
                vocab_size=256,
                seq_length=32,
                num_microbatches=2,
            ),
            warmup_pairs=1,
            pairs=2,
            export_repeats=3,
            direct_steps=1,
        ),
        flops_repeats=5,
        loop_repeats=1,
        report=dict(steps=300, layers=8, experts=16, table_every=1),
        store_repeats=3,
        wandb_repeats=1,
        routing_pairs=2,
        health_pairs=2,
        attach_layers=8,
        trl=dict(blocks=2, windows_per_block=1, model={}, logging_steps=2),
        ray=None,  # two more training launches: measured by --quick, not worth a smoke test
        html_loads=1,
    ),
}


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_ci95(values: list[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (binomial order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    # Largest k with P(Binomial(n, 1/2) < k) <= 0.025: [x_(k), x_(n-k+1)] covers the median.
    k, cumulative = 0, 0.0
    while k < n and cumulative + math.comb(n, k) / 2**n <= 0.025:
        cumulative += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few samples for 95%: the whole range
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slower rank: a collective step is as slow as its slowest rank."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def _site_diff(on: dict[str, int], off: dict[str, int]) -> dict[str, int]:
    keys = set(on) | set(off)
    return {k: on.get(k, 0) - off.get(k, 0) for k in sorted(keys) if on.get(k, 0) != off.get(k, 0)}


def summarise(
    ranks: list[dict[str, Any]],
    exports: list[dict[str, Any]],
    flops: dict[str, Any],
    store: dict[str, Any],
    report: dict[str, Any],
    routing: dict[str, Any] | None = None,
    health: dict[str, Any] | None = None,
    attach: dict[str, Any] | None = None,
    table: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON result: the keys of ``RESULT_KEYS``, then the details they were computed from.

    ``ranks``: the step ranks' results; ``exports``: the export ranks' results; ``store``:
    ``store_bench``'s result; ``report``: ``benchmarks.long_run.report_bench``'s result.
    """
    off = _slowest([r["step"]["off_s"] for r in ranks])
    on = _slowest([r["step"]["on_s"] for r in ranks])
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    off_cpu = _slowest([r["step"]["off_cpu_s"] for r in ranks])
    on_cpu = _slowest([r["step"]["on_cpu_s"] for r in ranks])
    cpu_ratios = [a / b for a, b in zip(on_cpu, off_cpu, strict=True)]
    # With several ranks, the one reaching the export last waits least in its collectives:
    # its time is the export's own cost, the others' include waiting for it.
    finish = [min(v) for v in zip(*[r["step"]["finish_on_s"] for r in ranks], strict=True)]
    export = _slowest([r["times_s"] for r in exports])

    per_mb, per_export, per_boundary = [], [], []
    for r in ranks:
        h_on, h_off = r["host_reads"]["on"], r["host_reads"]["off"]
        per_mb += [a - b for a, b in zip(h_on["microbatches"], h_off["microbatches"], strict=True)]
        per_export.append(h_on["export"] - h_off["export"])
        per_boundary.append(
            h_on["step_entry"] + h_on["step_exit"] - h_off["step_entry"] - h_off["step_exit"]
        )
    h0 = ranks[0]["host_reads"]
    direct = ranks[0]["direct"]
    direct_ms = {k[:-2] + "_ms": 1e3 * _median(v) for k, v in direct.items()}
    direct_total_ms = sum(direct_ms.values())
    ci_low, ci_high = median_ci95(ratios)

    checks = {
        f"step_{k[6:]}": all(r["step"][k] for r in ranks)
        for k in ranks[0]["step"]
        if k.startswith("check_")
    }
    checks.update(
        {
            f"export_{k[6:]}": all(r[k] for r in exports)
            for k in exports[0]
            if k.startswith("check_")
        }
    )
    checks.update({f"flops_{m}_same_total": v["check_same_total"] for m, v in flops.items()})
    checks.update(report["checks"])
    checks.update(store["checks"])
    tiled = report.get("tiled")
    if tiled is not None:
        checks.update(tiled["checks"])
    if routing is not None:
        checks.update(routing["checks"])
    if health is not None:
        checks.update(health["checks"])
    if attach is not None:
        checks.update(attach["checks"])
    if table is not None:
        checks.update(table["checks"])
    placement = report.get("placement")
    if placement is not None:
        checks.update(placement["checks"])
    html = report.get("html")
    if html is not None:
        checks.update(html["checks"])

    result: dict[str, Any] = {
        "step_overhead_ratio": _median(ratios),
        "export_ms_40x256": 1e3 * _median(export),
        "flops_estimate_ms_4096": max(v["vectorised_ms"] for v in flops.values()),
        "flops_vectorised_speedup": min(v["speedup"] for v in flops.values()),
        "syncs_per_microbatch": int(max(per_mb)),
        "syncs_per_export": int(max(per_export)),
        "report_seconds_10k_94x256": report["report_seconds"],
        "report_peak_rss_mb_10k_94x256": report["report_peak_rss_mb"],
        "report_seconds_10k_94x256_every_step": report["report_seconds_every_step"],
        "report_peak_rss_mb_10k_94x256_every_step": report["report_peak_rss_mb_every_step"],
        **{k: store[k] for k in RESULT_KEYS if k in store},
    }
    if routing is not None:
        result["routing_overhead_ratio"] = routing["routing_overhead_ratio"]
    if health is not None:
        result["router_health_overhead_ratio"] = health["router_health_overhead_ratio"]
        result["router_health_syncs_per_microbatch"] = health["router_health_syncs_per_microbatch"]
    if attach is not None:
        result["attach_seconds_94_layers"] = attach["attach_seconds"]
    if table is not None:
        result["table_step_host_ms_94x256"] = table["table_step_host_ms_94x256"]
    if placement is not None:
        result["placement_seconds_10k_94x256"] = placement["placement_seconds"]
    for key, got in (("html_report_mb_10k_94x256", "html_report_mb"), ("html_first_chart_s",) * 2):
        if html is not None and got in html:
            result[key] = html[got]
    if tiled is not None:
        result["report_seconds_100k_94x256_every_step"] = tiled["report_seconds"]
        result["report_peak_rss_mb_100k_94x256_every_step"] = tiled["report_peak_rss_mb"]
    result["met"] = {k: _meets(result[k], *TARGETS[k]) for k in RESULT_KEYS if k in result}
    result["targets"] = {k: f"{op} {v}" for k, (op, v) in TARGETS.items()}
    result["checks"] = checks
    result["details"] = {
        "step": {
            "pairs": len(ratios),
            "step_ms_off_median": 1e3 * _median(off),
            "step_ms_on_median": 1e3 * _median(on),
            "ratio_p25": _quantile(ratios, 0.25),
            "ratio_p75": _quantile(ratios, 0.75),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_ci95": [ci_low, ci_high],
            "ratios": ratios,
            # CPU seconds of the rank: blind to time the OS gave to other processes.
            "cpu_time_ratio_median": _median(cpu_ratios),
            "cpu_time_ratio_p25": _quantile(cpu_ratios, 0.25),
            "cpu_time_ratio_p75": _quantile(cpu_ratios, 0.75),
            "cpu_ms_off_median": 1e3 * _median(off_cpu),
            "cpu_ms_on_median": 1e3 * _median(on_cpu),
            # The metrics' own code, timed from inside (hooks, microbatch(), finish_step).
            "direct_ms_per_step": direct_total_ms,
            "direct_ms_breakdown": direct_ms,
            "direct_overhead_ratio": 1.0 + direct_total_ms / (1e3 * _median(off)),
            # The same code by metric family, CPU ms per step (median over the timed steps).
            "family_cpu_ms_per_step": {
                name: 1e3 * _median(values) for name, values in ranks[0]["families"].items()
            },
            "finish_step_ms_median": 1e3 * _median(finish),
            "finish_step_share_of_step": _median(finish) / _median(off),
            "metric_keys_per_step": ranks[0]["step"]["metric_keys"],
        },
        "export": {
            "repeats": len(export),
            "first_export_ms": 1e3 * max(r["first_s"] for r in exports),
            "p25_ms": 1e3 * _quantile(export, 0.25),
            "p75_ms": 1e3 * _quantile(export, 0.75),
            # CPU seconds of the busier rank: the work itself, without waiting for a core.
            "cpu_ms_median": 1e3 * _median(_slowest([r["cpu_times_s"] for r in exports])),
            "host_reads_per_export": max(r["host_reads"] for r in exports),
            "host_read_sites": exports[0]["host_read_sites"],
        },
        "flops": flops,
        "report": {**report["details"], "tiled": tiled},
        "placement": None if placement is None else placement["details"],
        "html": None if html is None else html["details"],
        "store": store["details"],
        "routing": (
            None
            if routing is None
            else {
                **routing["details"],
                "route_bytes_94x8x32k": routing["routing_route_bytes_94x8x32k"],
            }
        ),
        "router_health": None if health is None else health["details"],
        "table": None if table is None else table["details"],
        "host_reads": {
            "per_microbatch_on_minus_off": per_mb,
            "per_step_boundary_on_minus_off": max(per_boundary),
            "megatron_baseline_per_microbatch": h0["off"]["microbatches"],
            # Everything the step makes without metrics (megatron-core, the optimizer).
            "baseline_sites_per_step": h0["off"]["by_site"],
            "export_sites_on": _site_diff(h0["on"]["by_site"], h0["off"]["by_site"]),
        },
    }
    return result


def _meets(value: float, op: str, target: float) -> bool:
    if op == "<=":
        return value <= target
    if op == ">=":
        return value >= target
    return value == target


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "megatron_core": version("megatron-core"),
        "numpy": version("numpy"),
        "platform": platform.platform(),
    }


def _format(result: dict[str, Any]) -> str:
    lines = []
    for key in RESULT_KEYS:
        if key not in result:
            continue
        value = result[key]
        op, target = TARGETS[key]
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        verdict = "met" if result["met"][key] else "MISSED"
        lines.append(f"{key:<40} {shown:>12}   target {op} {target:<6} {verdict}")
    d = result["details"]["step"]
    lines.append(
        f"  step: off {d['step_ms_off_median']:.0f} ms, on {d['step_ms_on_median']:.0f} ms, "
        f"ratio 95% CI {d['ratio_ci95'][0]:.4f}-{d['ratio_ci95'][1]:.4f} over {d['pairs']} "
        f"pairs; CPU-time ratio {d['cpu_time_ratio_median']:.4f}; metrics' own code "
        f"{d['direct_ms_per_step']:.1f} ms/step (ratio {d['direct_overhead_ratio']:.4f})"
    )
    families = ", ".join(f"{k} {v:.2f}" for k, v in d["family_cpu_ms_per_step"].items())
    lines.append(f"  metrics' own CPU ms per step by family: {families}")
    st = result["details"]["store"]
    lines.append(
        f"  store: {st['store_bytes_per_table_step'] / 1e3:.0f} KB and "
        f"{st['store_write_ms_per_table_step']:.1f} ms "
        f"({st['store_write_cpu_ms_per_table_step']:.1f}"
        f" ms CPU) per table step; W&B {st['wandb']['table_step_ms']:.0f} ms "
        f"({st['wandb']['table_step_cpu_ms']:.0f} ms CPU) per table step; "
        f"one table every {st['table_every']} steps"
    )
    wl = st["wandb_loaded"]
    lines.append(
        f"  W&B loaded ({wl['busy_loop_processes']} busy-loop processes, one per logical CPU): "
        f"{wl['table_step_ms']:.0f} ms ({wl['table_step_cpu_ms']:.0f} ms CPU) per table step"
    )
    rd = result["details"]["report"]
    lines.append(
        f"  report: {rd['cpu_seconds']:.1f} s CPU at the default cadence, "
        f"{rd['every_step']['cpu_seconds']:.1f} s CPU with a table every step "
        f"({rd['every_step']['store_mb']:.0f} MB store)"
    )
    tiled = rd.get("tiled")
    if tiled is not None:
        lines.append(
            f"  report over {tiled['steps']:,} steps (a table every step, {tiled['store_mb']:.0f} "
            f"MB store, {tiled['jsonl_mb']:.0f} MB JSONL): {tiled['report_seconds']:.1f} s, "
            f"{tiled['cpu_seconds']:.1f} s CPU, {tiled['report_peak_rss_mb']:.0f} MB peak"
        )
    for family, label in (("routing", "routing"), ("router_health", "router-health")):
        d = result["details"].get(family)
        if d is None:
            continue
        line = (
            f"  {label}: off {d['step_ms_off_median']:.0f} ms, on {d['step_ms_on_median']:.0f} ms "
            f"over {d['pairs']} pairs; CPU-time ratio {d['cpu_time_ratio_median']:.4f}; {label} "
            f"code {d['direct_ms_per_step']:.1f} ms/step (ratio {d['direct_overhead_ratio']:.4f})"
        )
        if family == "routing":
            line += (
                "; routes of one microbatch at 94 layers x top-8 x 32k tokens: "
                f"{d['route_bytes_94x8x32k']:,} bytes ({d['route_memory_mib']:.0f} MiB, int64)"
            )
        lines.append(line)
    trl = result["details"].get("trl")
    if isinstance(trl, dict):
        lines.append(
            f"  trl: off {trl['step_ms_off_median']:.0f} ms, on {trl['step_ms_on_median']:.0f} ms "
            f"a step over {trl['steps']} steps, logging_steps={trl['logging_steps']}; the "
            f"callback's own code {trl['callback_cpu_ms_per_step']:.1f} ms CPU a step (ratio "
            f"{trl['callback_cpu_ratio']:.4f}); paired steps: not logging "
            f"{trl['quiet_step_ratio']:.4f}, logging {trl['log_step_ratio']:.4f} "
            f"({trl['log_step_ms_on_median']:.0f} / {trl['log_step_ms_off_median']:.0f} ms, "
            "what logging_steps=1 costs)"
        )
    ray = result["details"].get("ray")
    if isinstance(ray, dict):
        lines.append(
            f"  ray: step {ray['ray_step_ms_median']:.0f} ms on Ray, "
            f"{ray['torchrun_step_ms_median']:.0f} ms under torchrun (runs: "
            + ", ".join(f"{t:.0f}" for t in ray["torchrun_step_ms_each_run"])
            + f" ms); a no-op call {ray['no_op_call_ms']:.2f} ms"
        )
    hd = result["details"].get("html")
    if hd and "bytes" in hd:
        lines.append(
            f"  report --html: {hd['bytes'] / 1e6:.2f} MB page, command {hd['command_seconds']:.1f}"
            f" s; first chart {', '.join(f'{s:.2f}' for s in hd.get('first_chart_s', []))} s "
            f"({hd.get('browser')})"
        )
    sites = result["details"]["host_reads"]["export_sites_on"]
    lines.append("  host reads added per step: " + (json.dumps(sites) if sites else "none"))
    failed = [k for k, ok in result["checks"].items() if not ok]
    lines.append("  checks: " + ("all passed" if not failed else "FAILED " + ", ".join(failed)))
    return "\n".join(lines)


def _add_trl(result: dict[str, Any], preset: dict[str, Any]) -> None:
    # TRL is an extra: without it the key is absent (and says so), never a made-up number.
    if importlib.util.find_spec("trl") is None:
        result["details"]["trl"] = "not measured: TRL is not installed (extra 'trl')"
        return
    trl = trl_bench(**preset)
    key = "trl_callback_overhead_ratio"
    result[key] = trl[key]
    result["met"][key] = _meets(trl[key], *TARGETS[key])
    result["details"]["trl"] = trl


def _add_ray(result: dict[str, Any], preset: dict[str, Any] | None) -> None:
    # The Ray engine's step time over torchrun's, and a 94 x 256 table's trip to the driver.
    if preset is None:  # absent (and said so), never made up
        result["details"]["ray"] = "not measured in --smoke (two training launches): --quick"
        return
    ray = ray_bench(**preset)
    for key in ("ray_step_ratio", "ray_table_transfer_ms_94x256"):
        result[key] = ray[key]
        result["met"][key] = _meets(ray[key], *TARGETS[key])
    result["details"]["ray"] = ray["details"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, print a summary, optionally write JSON; 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer repeats (about 5 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, to test the harness")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--pairs", type=int, help="interleaved on/off step pairs (after warm-up)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence of the step model")
    parser.add_argument(
        "--on",
        choices=("all", "moe", "throughput", "none"),
        default="all",
        help="metrics of the 'on' model: all (the benchmark); moe or throughput to attribute a "
        "cost; none for an A/A run that shows the ratio's noise floor",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the ranks")
    parser.add_argument(
        "--slow",
        action="store_true",
        help="also time the report over 100,000 steps at 94 x 256, a table every step "
        "(about 10 GB in the temporary folder, 10 more minutes)",
    )
    args = parser.parse_args(argv)

    preset = PRESETS["smoke" if args.smoke else "quick" if args.quick else "full"]
    bench: BenchConfig = preset["bench"]
    if args.pairs is not None:
        if args.pairs < 1:
            parser.error(f"--pairs must be >= 1, got {args.pairs}")
        bench = replace(bench, pairs=args.pairs)
    if args.seq_length is not None:
        if args.seq_length < 2:
            parser.error(f"--seq-length must be >= 2, got {args.seq_length}")
        bench = replace(bench, step=replace(bench.step, seq_length=args.seq_length))

    bench = replace(bench, on=args.on)
    started = time.perf_counter()
    load_before = os.getloadavg()
    ranks = spawn_ranks(
        step_rank, STEP_WORLD_SIZE, bench, timeout=args.timeout, threads=bench.threads
    )
    exports = spawn_ranks(
        export_rank, EXPORT_WORLD_SIZE, bench, timeout=args.timeout, threads=bench.threads
    )
    flops = flops_bench(
        FLOPS_FIXTURES,
        num_sequences=4096,
        repeats=preset["flops_repeats"],
        loop_repeats=preset["loop_repeats"],
    )
    store = store_bench(
        LoggerConfig().table_every, preset["store_repeats"], preset["wandb_repeats"]
    )
    with tempfile.TemporaryDirectory(prefix="nmm_report_") as work:
        report = report_bench(Path(work), **preset["report"])
        shape = preset["report"]
        report["placement"] = placement_bench(
            Path(work) / "run_every_step",  # report_bench's run with a table every step
            Path(work) / "PLAN.json",
            layers=shape["layers"],
            experts=shape["experts"],
        )
        report["html"] = html_bench(
            Path(work) / "run_every_step", Path(work) / "html", loads=preset["html_loads"]
        )
        if args.slow or args.smoke:  # smoke: 10 x 300 steps at 8 x 16, to test the harness
            report["tiled"] = tiled_report_bench(Path(work), repeats=10)
    routing = routing_bench(bench.step, preset["routing_pairs"], timeout=args.timeout)
    health = router_health_bench(bench.step, preset["health_pairs"], timeout=args.timeout)
    attach = attach_bench(layers=preset["attach_layers"])
    table = table_step_bench(preset["store_repeats"])
    result = summarise(ranks, exports, flops, store, report, routing, health, attach, table)
    _add_trl(result, preset["trl"])
    _add_ray(result, preset["ray"])
    result["machine"] = {
        **machine(),
        "load_average_1m_before": load_before[0],
        "load_average_1m_after": os.getloadavg()[0],
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    result["config"] = {
        "preset": "smoke" if args.smoke else "quick" if args.quick else "full",
        "step_world_size": STEP_WORLD_SIZE,
        "export_world_size": EXPORT_WORLD_SIZE,
        **asdict(bench),
        "flops_fixtures": FLOPS_FIXTURES,
    }
    result["wall_seconds"] = time.perf_counter() - started
    print(_format(result))
    print(f"  ({result['wall_seconds']:.0f} s, load average {load_before[0]:.1f} at start)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
