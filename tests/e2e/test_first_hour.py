"""A new user's first hour (issue 25): the messages an API user meets are in the caller's terms
(MetricsConfig flags, the five PolicyMetrics calls), not the launcher's."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_moe_metrics.config import preflight as _preflight

MCFG = _preflight.MCFG  # the recipe's metric-flag block, "policy.<worker>_cfg"


# --------------------------------------------------------------------------- 5. caller's terms


def _api_run(run_dir: Path, rows: dict[int, dict], config=None) -> Path:
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, run_dir, run_name="api", config=config)
    for step, metrics in rows.items():
        sink.log(metrics, step)
    sink.close()
    return run_dir


def _table(counts):
    return [[0, e, c, 100.0 * c / sum(counts)] for e, c in enumerate(counts)]


def test_report_hints_speak_metricsconfig_to_api_users(tmp_path):
    from nemo_moe_metrics import render_report

    perf = {"train_perf/tokens_per_second": 50.0, "train_perf/tflops_per_gpu": 0.001}
    rows = {0: {**perf, "moe/expert_loads": _table([3, 1, 2, 2])}, 1: dict(perf)}
    summary = render_report(_api_run(tmp_path / "api", rows))
    assert (
        "MFU not logged (unknown accelerator peak; pass MetricsConfig(peak_flops_per_gpu=...))"
        in (summary)
    )
    assert "aux losses: not logged; enable MetricsConfig(track_moe_metrics=True)" in summary
    assert MCFG not in summary and "logger." not in summary
    # The whole run holds one table step: no --steps to widen; log the table more often.
    assert (
        "only 1 logged step with expert counts in the whole run: expert_load_over_steps.png and "
        "routing_drift.png skipped; they need 2 or more: log the table more often with "
        "LoggerConfig(table_every=...), or train more steps"
    ) in summary
    assert "--steps" not in summary
    # The same run written by a recipe (run.json holds the Recipe dump) gets recipe keys.
    recipe = _api_run(tmp_path / "recipe", rows, config={"algorithm": "grpo"})
    summary = render_report(recipe)
    assert f"set {MCFG}.peak_flops_per_gpu" in summary
    assert "log the table more often with logger.table_every, or train more steps" in summary


def test_microbatch_outside_step_names_the_public_calls():
    import torch
    from hf_tiny import tiny_config

    from nemo_moe_metrics import MetricsConfig, PolicyMetrics

    metrics = PolicyMetrics(MetricsConfig(track_throughput=True))
    metrics.attach(torch.nn.Linear(2, 2), tiny_config("qwen3_moe"))
    with pytest.raises(RuntimeError) as err:
        metrics.microbatch(torch.tensor([5, 7]))
    assert str(err.value) == (
        "PolicyMetrics.microbatch() called outside a step; call it once per training "
        "microbatch inside `with metrics.step():` (before the microbatch's forward), then "
        "finish_step() after the block"
    )
    assert "add_sequences" not in str(err.value) and "meter" not in str(err.value)
    nested = pytest.raises(RuntimeError, match=r"PolicyMetrics.step\(\) is already open")
    with metrics.step(), nested, metrics.step():
        pass
    with metrics.step():  # the failed nesting left no open step behind
        metrics.microbatch(torch.tensor([5, 7]))
    assert metrics.finish_step(1)["train_perf/tokens"] == 12


def test_unknown_router_warning_on_a_one_process_hf_model_does_not_mention_pipelines():
    import torch
    from hf_tiny import tiny_config

    from nemo_moe_metrics import MetricsConfig, PolicyMetrics

    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    with pytest.warns(RuntimeWarning) as caught:
        metrics.attach(torch.nn.Linear(2, 2), tiny_config("qwen3_moe"))
    text = str(caught[0].message)
    assert "the config (qwen3_moe) says 8 experts but the model has no module that follows" in text
    assert "experts(hidden_states, top_k_index, top_k_weights)" in text
    assert "docs/en/models.md" in text
    assert "nemo_moe_metrics.register_router(RouterClass, counts_fn)" in text
    assert "pipeline" not in text
