"""The report's placement section (report/placement.py): placement and rollout loads beside
training."""

import numpy as np

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report import render_report
from nemo_moe_metrics.sinks import build_sinks
from nemo_moe_metrics.sinks.rollout_store import (
    record_rollout_loads,
)


def test_report_shows_placement_and_rollout_beside_training(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    config = {"policy": {"megatron_cfg": {"expert_model_parallel_size": 2}}}
    sink = build_sinks(cfg, tmp_path, run_name="tiny", config=config)
    rng = np.random.default_rng(6)
    total = np.zeros((2, 8), np.int64)
    for step in range(3):
        c = rng.integers(1, 100, size=(2, 8))
        total += c
        rows = [[la, e, int(c[la, e]), 0.0] for la in range(2) for e in range(8)]
        extra = {mn.EXPERT_IMBALANCE_SLOWDOWN: 1.25, mn.MFU: 0.4} if step == 2 else {}
        sink.log({mn.EXPERT_LOADS: rows, **extra}, step)
    sink.close()
    rollout = np.zeros((2, 8), np.int64)
    rollout[:, 5] = 100
    rollout[:, 0] = 1
    record_rollout_loads(tmp_path, 2, [0, 1], rollout)
    text = render_report(tmp_path)
    assert "MFU 40.0% would be 50.0% with balance" in text
    # The run's EP size (2, from run.json): busiest rank over the mean rank, by hand.
    ratios = [max(r[:4].sum(), r[4:].sum()) / (r.sum() / 2) for r in total]
    worst = int(np.argmax(ratios))
    assert "EP ranks (G=2)" in text and f"worst: layer {worst} {ratios[worst]:.2f}" in text
    assert "placement (train loads, steps 0–2, 2 GPUs)" in text
    assert "placement (rollout loads" in text
    hot_same = sum(int(total[la].argmax() == 5) for la in range(2))
    assert f"the hottest expert is the same in {hot_same} of 2 layers" in text
    assert (tmp_path / "placement_sweep.png").stat().st_size > 0
    assert (tmp_path / "rollout_vs_train_load.png").stat().st_size > 0
