"""The host time a 94 x 256 expert-table step adds: ``table_step_host_ms_94x256``.

From the host read to the sinks: the step's reduced counts (an ``ExpertLoads`` as the one host
read returns it, 94 MoE layers x 256 experts, ``benchmarks.store_bench.step_counts``) go
through ``expert_load_metrics`` (statistics, per-layer keys, the table value) and the
``MultiSink`` that ``build_sinks`` makes with the local defaults: the alert monitor (default
thresholds, it reads the table), validation, the JSONL file and the expert-load store (its
write and fsync call included). W&B (``wandb_table_ms_94x256``) and TensorBoard (no tables)
are left out. Timed in CPU seconds of this process (blind to other processes' load; the fsync's
wait for the disk is not CPU time), interleaved: a table step (``log_expert_table``, on the
cadence) against the same step without the table; the figure is the difference of medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.store_bench import EXPERTS, LAYERS, TOKENS_PER_STEP, step_counts


def table_step_bench(repeats: int) -> dict[str, Any]:
    """``table_step_host_ms_94x256`` and its details (table and no-table medians, ms CPU)."""
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.moe.balance import ExpertLoads, expert_load_metrics
    from nemo_moe_metrics.sinks import build_sinks

    cfg = LoggerConfig(wandb_enabled=False, tensorboard_enabled=False, table_every=1)
    cpu: dict[bool, list[float]] = {True: [], False: []}
    rows = 0
    with tempfile.TemporaryDirectory(prefix="nmm_table_bench_") as tmp:
        sink = build_sinks(cfg, Path(tmp), run_name="table_bench")
        try:
            for step in range(2 * repeats + 2):
                counts = step_counts(step)
                loads = ExpertLoads(
                    layer_ids=list(range(LAYERS)),
                    counts=counts,
                    routed_tokens=np.full(LAYERS, TOKENS_PER_STEP // 8, dtype=np.int64),
                    topk=8,
                )
                table = step % 2 == 0
                c0 = time.process_time()
                metrics = expert_load_metrics(loads, per_layer=True, table=table)
                sink.log(metrics, step)
                elapsed = time.process_time() - c0
                if step >= 2:  # the first pair warms the files and caches
                    cpu[table].append(elapsed)
                if table:
                    rows = len(metrics[mn.EXPERT_LOADS])
        finally:
            sink.close()
    on, off = (1e3 * statistics.median(cpu[k]) for k in (True, False))
    return {
        "table_step_host_ms_94x256": on - off,
        "checks": {"table_step_rows_94x256": rows == LAYERS * EXPERTS},
        "details": {
            "repeats": repeats,
            "table_step_cpu_ms": on,
            "step_without_table_cpu_ms": off,
            "included": "expert_load_metrics' table value, alerts, validation, JSONL, "
            "expert-load store (write + fsync call)",
        },
    }


if __name__ == "__main__":
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(json.dumps(table_step_bench(int(sys.argv[1]) if len(sys.argv) > 1 else 20), indent=2))
