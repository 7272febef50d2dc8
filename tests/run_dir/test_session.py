"""How a run directory is opened (run_dir/session.py: open_run, build_sinks): one run per
directory, overwrite keeps the user's files, resume continues, a run that failed before logging
does not block."""

from __future__ import annotations

import json

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import NullSink, build_sinks

# --------------------------------------------------------------------------- 2. build_sinks


def _log_steps(sink, steps):
    for step in steps:
        sink.log({"train/loss": float(step)}, step)
    sink.close()


def test_build_sinks_refuses_a_directory_that_holds_a_run(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks
    from nemo_moe_metrics.sinks import RunExistsError

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="first"), range(3))
    before = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()
    with pytest.raises(RunExistsError) as err:
        build_sinks(cfg, tmp_path, run_name="second")
    assert f"{tmp_path} already holds a run (metrics.jsonl)" in str(err.value)
    assert "Pass LoggerConfig(resume=True) to continue it" in str(err.value)
    assert "build_sinks(..., overwrite=True)" in str(err.value)
    after = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()
    assert after == before, "nothing was touched"


def test_build_sinks_overwrite_replaces_the_run_and_keeps_the_users_files(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="first"), range(3))
    first_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    (tmp_path / "checkpoint.pt").write_bytes(b"user data")
    (tmp_path / "expert_load_heatmap.png").write_bytes(b"old picture")
    _log_steps(build_sinks(cfg, tmp_path, run_name="second", overwrite=True), [0])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["run_name"] == "second" and meta["run_id"] != first_id
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"user data"
    assert not (tmp_path / "expert_load_heatmap.png").exists()


def test_build_sinks_resume_continues_the_run(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="r"), range(2))
    _log_steps(build_sinks(cfg.model_copy(update={"resume": True}), tmp_path, run_name="r"), [2])
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


# --------------------------------------------------------------------------- 12. failed early


def test_a_run_that_failed_before_logging_does_not_block_build_sinks(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=True, wandb_enabled=False)
    build_sinks(cfg, tmp_path, run_name="crashed").close()  # opened, then died: nothing logged
    assert (tmp_path / "metrics.jsonl").stat().st_size == 0
    _log_steps(build_sinks(cfg, tmp_path, run_name="rerun"), range(2))
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_rank_other_than_zero_gets_a_null_sink_that_writes_nothing(tmp_path):
    sink = build_sinks(LoggerConfig(), tmp_path / "run", run_name="r", rank=1)
    sink.log({mn.TOKENS: 1}, 0)
    sink.close()
    assert isinstance(sink, NullSink)
    assert not (tmp_path / "run").exists()
