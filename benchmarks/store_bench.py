"""The table outputs at 94 layers x 256 experts: expert-load store and W&B, per step.

``store_bench(...)`` times the real sinks (``ExpertLoadSink``, ``WandbSink`` offline) on one
realistic step table (Qwen3-235B's shape: 94 MoE layers x 256 experts; 4M tokens x top-8
per step, so counts need 32 bits) and reports per step, amortised at the default cadence
(``logger.table_every``): a table step's cost over ``table_every`` steps, plus the steps in
between (which carry scalars only). The per-table-step figures are in the details.
W&B is timed twice: as the machine is, and loaded with one busy-loop process per logical CPU
(``busy_cores``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

LAYERS, EXPERTS = 94, 256
TOKENS_PER_STEP = 4_000_000 * 8  # 4M tokens, top-8 routing


def step_counts(step: int, seed: int = 0) -> np.ndarray:
    """[94, 256] token counts of one step: skewed per-layer loads that drift over steps."""
    rng = np.random.default_rng([seed, step])
    base = np.random.default_rng(seed).dirichlet(np.full(EXPERTS, 5.0), size=LAYERS)
    noise = rng.dirichlet(np.full(EXPERTS, 50.0), size=LAYERS)
    p = 0.8 * base + 0.2 * noise
    return np.stack([rng.multinomial(TOKENS_PER_STEP, row) for row in p])


def table_rows(counts: np.ndarray) -> list[list]:
    """The ``moe/expert_loads`` rows the worker would log for ``counts``."""
    totals = counts.sum(axis=1)
    return [
        [la, e, int(c), 100.0 * int(c) / int(totals[la])]
        for la, layer in enumerate(counts)
        for e, c in enumerate(layer)
    ]


def _median_ms(values: list[float]) -> float:
    return 1e3 * float(statistics.median(values))


def _scalars(step: int) -> dict[str, float]:
    return {"moe/max_over_ideal": 1.5 + 1e-3 * step, "train_perf/tokens": 4e6}


def store_bench(table_every: int, table_repeats: int, wandb_repeats: int) -> dict[str, Any]:
    """Time the store and W&B sinks at 94 x 256; amortised per step at ``table_every``."""
    from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
    from nemo_moe_metrics.sinks.store import ExpertLoadSink, read_expert_loads, store_path

    tables = [step_counts(s) for s in range(table_repeats)]
    rows = [table_rows(c) for c in tables]
    with tempfile.TemporaryDirectory(prefix="nmm_store_bench_") as tmp:
        path = store_path(Path(tmp))
        sink = ExpertLoadSink(path, table_every=1)
        write_s, write_cpu_s, sizes = [], [], []
        for i, r in enumerate(rows):
            before = path.stat().st_size
            c0, t0 = time.process_time(), time.perf_counter()
            sink.log({EXPERT_LOADS: r, **_scalars(i)}, i)
            write_s.append(time.perf_counter() - t0)
            write_cpu_s.append(time.process_time() - c0)
            sizes.append(path.stat().st_size - before)
        # A step off the cadence: the sink sees the table and skips it.
        sparse = ExpertLoadSink(Path(tmp) / "sparse.bin", table_every=table_every)
        skip_s = []
        for i in range(1, min(table_every, 20)):
            t0 = time.perf_counter()
            sparse.log({EXPERT_LOADS: rows[0], **_scalars(i)}, i)
            skip_s.append(time.perf_counter() - t0)
        sink.close()
        sparse.close()
        read_back = list(read_expert_loads(path))
        exact = len(read_back) == len(tables) and all(
            np.array_equal(c, t) for (_, _, c), t in zip(read_back, tables, strict=True)
        )
        t0 = time.perf_counter()
        for _ in read_expert_loads(path):
            pass
        read_ms = 1e3 * (time.perf_counter() - t0) / len(tables)

    wandb = _wandb_bench(rows[0], wandb_repeats, table_every)
    with busy_cores() as hogs:
        loaded = _wandb_bench(rows[0], wandb_repeats, table_every)
    loaded["busy_loop_processes"] = hogs
    table_ms = _median_ms(write_s)
    skip_ms = _median_ms(skip_s) if skip_s else 0.0
    bytes_table = float(statistics.median(sizes))
    amortised_ms = (table_ms + (table_every - 1) * skip_ms) / table_every
    return {
        "store_bytes_per_step_94x256": bytes_table / table_every,
        "store_write_ms_94x256": amortised_ms,
        "store_bytes_per_table_step_94x256": bytes_table,
        "store_write_ms_per_table_step_94x256": table_ms,
        "wandb_table_ms_94x256": wandb["amortised_ms"],
        "wandb_table_ms_94x256_loaded": loaded["amortised_ms"],
        "checks": {"store_round_trip_exact": exact},
        "details": {
            "table_every": table_every,
            "store_bytes_per_table_step": bytes_table,
            "store_write_ms_per_table_step": table_ms,
            "store_write_ms_p90_per_table_step": 1e3 * float(np.quantile(write_s, 0.9)),
            # CPU time of the writing process: the cost without waiting for a busy core.
            "store_write_cpu_ms_per_table_step": _median_ms(write_cpu_s),
            "store_ms_per_step_off_cadence": skip_ms,
            "store_read_ms_per_step": read_ms,
            "store_raw_int32_bytes": LAYERS * EXPERTS * 4,
            "jsonl_table_bytes_before_store": len(_json_line(rows[0])),
            "table_repeats": len(write_s),
            "per_table_step_targets_met": {
                "store_bytes_per_table_step <= 100000": bytes_table <= 100_000,
                "store_write_ms_per_table_step <= 5": table_ms <= 5.0,
            },
            "wandb": wandb,
            # The same, while one busy-loop process per logical CPU keeps every core busy.
            "wandb_loaded": loaded,
            "table_outputs_10k_steps_mb": 1e-6
            * (10_000 // table_every)
            * (bytes_table + wandb["table_bytes"]),
        },
    }


@contextlib.contextmanager
def busy_cores(n: int | None = None) -> Iterator[int]:
    """Load the machine: ``n`` (default: one per logical CPU) processes spinning in a Python
    loop until the block ends; yields how many. The measured process then shares each core
    with a spinning one, besides whatever else runs."""
    n = (os.cpu_count() or 1) if n is None else n
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        time.sleep(0.2)  # let them start spinning
        yield n
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _json_line(rows: list[list]) -> str:
    import json

    return json.dumps({"step": 0, "moe/expert_loads": rows}, separators=(",", ":"))


def _wandb_bench(rows: list[list], repeats: int, table_every: int) -> dict[str, Any]:
    """W&B offline: ms per table step and per scalar step, the table's bytes on disk."""
    os.environ.setdefault("WANDB_SILENT", "true")
    from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
    from nemo_moe_metrics.sinks.wandb import WandbSink

    with tempfile.TemporaryDirectory(prefix="nmm_wandb_bench_") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sink = WandbSink(Path(tmp), mode="offline", project="bench", run_name="bench")
        table_s, table_cpu_s, scalar_s = [], [], []
        step = 0
        for _ in range(repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            sink.log({EXPERT_LOADS: rows, **_scalars(step)}, step)
            table_s.append(time.perf_counter() - t0)
            table_cpu_s.append(time.process_time() - c0)
            step += 1
            for _ in range(5):
                t0 = time.perf_counter()
                sink.log(_scalars(step), step)
                scalar_s.append(time.perf_counter() - t0)
                step += 1
        sink.close()
        files = list(Path(tmp).glob("wandb/offline-run-*/files/media/table/**/*.table.json"))
        table_bytes = float(statistics.median(f.stat().st_size for f in files)) if files else 0.0
    table_ms, scalar_ms = _median_ms(table_s), _median_ms(scalar_s)
    return {
        "table_step_ms": table_ms,
        # CPU time of this process (W&B's own service process not included): the cost
        # without waiting for a busy core.
        "table_step_cpu_ms": _median_ms(table_cpu_s),
        "scalar_step_ms": scalar_ms,
        # The table's own cost (a table step minus a scalar step), spread over the cadence.
        "amortised_ms": max(0.0, table_ms - scalar_ms) / table_every,
        "table_bytes": table_bytes,
        "table_repeats": len(table_s),
    }
