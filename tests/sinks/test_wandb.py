"""W&B offline: the 64 x 256 expert table keeps every row; a W&B that cannot start is survivable."""

import json

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import build_sinks


def test_wandb_table_keeps_all_rows_of_64_layers_by_256_experts(tmp_path):
    n_layers, n_experts = 64, 256
    rows = [
        [la, e, (la * 7 + e * 13) % 101, round(100 * ((la * 7 + e * 13) % 101) / 12345, 6)]
        for la in range(n_layers)
        for e in range(n_experts)
    ]
    assert len(rows) > 10_000  # more than W&B's default table limit
    cfg = LoggerConfig(
        jsonl_enabled=False, tensorboard_enabled=False, wandb_mode="offline", table_every=1
    )
    sink = build_sinks(cfg, tmp_path, run_name="wide", config={"a": 1})
    sink.log({mn.EXPERT_LOADS: rows, mn.MAX_OVER_IDEAL: 1.75}, step=5)
    run = sink.sinks[0].run
    assert run.summary[mn.MAX_OVER_IDEAL] == 1.75
    sink.close()

    files = list((tmp_path / "wandb").glob("offline-run-*/files/media/table/moe/expert_loads_*"))
    assert len(files) == 1, files
    table = json.loads(files[0].read_text())
    assert table["columns"] == list(mn.EXPERT_LOAD_COLUMNS)
    assert len(table["data"]) == n_layers * n_experts
    assert table["data"] == rows


def test_wandb_table_every_n_steps_keeps_scalars_every_step(tmp_path):
    cfg = LoggerConfig(
        jsonl_enabled=False, tensorboard_enabled=False, wandb_mode="offline", wandb_table_every=2
    )
    sink = build_sinks(cfg, tmp_path, run_name="r")
    run = sink.sinks[0].run
    for step in range(4):
        sink.log({mn.EXPERT_LOADS: [[0, 0, step, 100.0]], mn.TOKENS: step}, step)
        assert run.summary[mn.TOKENS] == step
    sink.close()
    files = (tmp_path / "wandb").glob("offline-run-*/files/media/table/moe/expert_loads_*")
    tokens = sorted(json.loads(f.read_text())["data"][0][2] for f in files)
    assert tokens == [0, 2]


def test_wandb_table_every_zero_is_refused():
    from nemo_moe_metrics.config import ConfigError, recipe_from_dict

    with pytest.raises(
        ConfigError, match=r"logger\.wandb_table_every: .*greater than or equal to 1"
    ):
        recipe_from_dict({"policy": {"model": {}}, "logger": {"wandb_table_every": 0}})


def test_wandb_follows_table_every_when_wandb_table_every_is_unset(tmp_path):
    cfg = LoggerConfig(
        jsonl_enabled=False, tensorboard_enabled=False, wandb_mode="offline", table_every=3
    )
    sink = build_sinks(cfg, tmp_path, run_name="r")
    for step in range(7):
        sink.log({mn.EXPERT_LOADS: [[0, 0, step, 100.0]], mn.TOKENS: step}, step)
    sink.close()
    files = (tmp_path / "wandb").glob("offline-run-*/files/media/table/moe/expert_loads_*")
    assert sorted(json.loads(f.read_text())["data"][0][2] for f in files) == [0, 3, 6]


def test_wandb_table_declares_number_columns_and_refuses_a_missing_cell(tmp_path):
    import wandb

    from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
    from nemo_moe_metrics.sinks.wandb import WandbSink

    sink = WandbSink(tmp_path, mode="offline", project="t", run_name="t")
    try:
        rows = [[0, e, 10 * e, 100.0 * e / 60] for e in range(4)]
        table = sink._table(EXPERT_LOADS, rows)
        # The same column types and rows as W&B's own row-by-row inference.
        inferred = wandb.Table(columns=list(table.columns), data=rows, optional=False)
        assert table._column_types.to_json() == inferred._column_types.to_json()
        assert table.data == inferred.data
        for bad in ([[0, 1, None, 2.0]], [[0, 1, 2]], [[0, 1, "x", 2.0]]):
            with pytest.raises(TypeError, match="numbers"):
                sink._table(EXPERT_LOADS, bad)
    finally:
        sink.close()
