"""TensorBoard: scalars read back with tensorboard's own reader; the table never becomes series."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import TENSORBOARD_DIR, build_sinks


def test_tensorboard_holds_moe_and_perf_scalars_and_no_per_expert_series(tmp_path):
    n_layers, n_experts = 2, 8
    scalars = {
        0: {mn.MAX_OVER_IDEAL: 1.5, mn.aux_loss_key("load_balancing_loss"): 1.02},
        1: {mn.MAX_OVER_IDEAL: 1.25, mn.aux_loss_key("load_balancing_loss"): 1.01},
    }
    for step, values in scalars.items():
        values[mn.layer_stat_key(1, "max_over_ideal")] = 2.0 + step
        values[mn.TOKENS_PER_SECOND] = 1000.0 * (step + 1)
        values[mn.TOTAL_TOKENS] = 4096 * (step + 1)
    cfg = LoggerConfig(jsonl_enabled=False, wandb_enabled=False)
    sink = build_sinks(cfg, tmp_path, run_name="r")
    for step, values in scalars.items():
        table = [[la, e, 3, 100 / n_experts] for la in range(n_layers) for e in range(n_experts)]
        sink.log({**values, mn.EXPERT_LOADS: table}, step)
    sink.close()

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(scalars[0])  # exactly the scalars: no table, no per-expert tag
    assert mn.EXPERT_LOADS not in tags
    for tag in tags:
        got = [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]
        assert got == [(s, float(v[tag])) for s, v in scalars.items()], tag
