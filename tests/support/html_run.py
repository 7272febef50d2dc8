"""A small run directory written by the real sinks, with every family the page draws: training
and rollout expert loads (stores), a dead expert, alerts, throughput, FLOPs, aux losses, router
health and routing consistency. The page tests read it back through the store reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import RUN_FILE, run_metadata
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink
from nemo_moe_metrics.sinks.rollout_store import record_rollout_loads
from nemo_moe_metrics.sinks.store import ExpertLoadStore, store_path

STEPS = 12
LAYERS = [1, 2, 3]  # global MoE layer ids (layer 0 dense)
EXPERTS = 8
DEAD = (2, 5, 4)  # layer 2's expert 5 gets no token from step 4 on
ALERT_STEP = 6
ROLLOUT_STEPS = range(8, STEPS)


def counts_at(step: int) -> np.ndarray:
    """``[layers, experts]`` tokens of ``step``: skewed, varied, the dead expert at 0."""
    rng = np.random.default_rng(step)
    counts = rng.integers(50, 400, (len(LAYERS), EXPERTS)) * (1 + np.arange(EXPERTS) % 3)
    layer, expert, start = DEAD
    if step >= start:
        counts[LAYERS.index(layer), expert] = 0
    return counts.astype(np.int64)


def write_run(run_dir: Path) -> Path:
    """Write the run into ``run_dir``; returns it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"policy": {"model": {"num_experts": EXPERTS, "moe_router_topk": 2}}}
    (run_dir / RUN_FILE).write_text(json.dumps(run_metadata("html_page_run", config)))
    jsonl = JsonlSink(run_dir / METRICS_FILE, fsync=False)
    with ExpertLoadStore(store_path(run_dir), fsync=False) as store:
        for step in range(STEPS):
            counts = counts_at(step)
            store.append(step, LAYERS, counts)
            record = {
                mn.TOKENS: 4096.0,
                mn.SECONDS: 0.5 + 0.01 * step,
                mn.TOKENS_PER_SECOND: 4096 / (0.5 + 0.01 * step),
                mn.TFLOPS_PER_GPU: 1.5 + 0.1 * step,
                mn.MFU: 0.2 + 0.01 * step,
                mn.aux_loss_key("load_balancing_loss"): 1.1 - 0.01 * step,
                mn.aux_loss_key(mn.Z_LOSS): 0.5,
                mn.ROUTER_CONFIDENCE: 0.3 + 0.01 * step,
                mn.ROUTER_NEAR_TIE_FRACTION: 0.2,
                mn.ROUTER_NEAR_TIE_FRACTION_MAX: 0.3,
                mn.ROUTING_DISAGREEMENT: 0.05,
                mn.MAX_OVER_IDEAL: 1.5,
            }
            for i, layer in enumerate(LAYERS):
                record[mn.routing_layer_key(layer, "routing_disagreement")] = 0.01 * (i + 1)
            alerts = []
            if step == ALERT_STEP:
                alerts = [{"kind": "dead", "layer": 2, "expert": 5,
                           "message": f"moe alert step {step}: layer 2 expert 5 dead"}]  # fmt: skip
            jsonl.log(record, step, alerts)
    jsonl.close()
    for step in ROLLOUT_STEPS:
        record_rollout_loads(run_dir, step, LAYERS, counts_at(step)[:, ::-1].copy())
    return run_dir


def streak_at(step: int, layer: int, expert: int) -> int:
    """Zero-token logged steps of ``(layer, expert)`` up to and including ``step``, counted
    from the counts above."""
    n = 0
    for s in range(step + 1):
        n = n + 1 if counts_at(s)[LAYERS.index(layer), expert] == 0 else 0
    return n
