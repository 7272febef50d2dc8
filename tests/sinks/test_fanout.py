"""The backends a logger config turns on (sinks/fanout.py): one that cannot start warns and is left
out, the others keep logging."""

import json
import warnings

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import METRICS_FILE, build_sinks


def test_wandb_that_cannot_start_warns_and_jsonl_keeps_logging(tmp_path):
    (tmp_path / "wandb").write_text("a file where W&B wants its directory")
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_mode="offline")
    with pytest.warns(RuntimeWarning, match=r"W&B sink could not start .*wandb_enabled=false"):
        sink = build_sinks(cfg, tmp_path, run_name="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more to say once W&B is left out
        sink.log({mn.TOKENS: 7}, step=0)
        sink.close()
    assert json.loads((tmp_path / METRICS_FILE).read_text()) == {"step": 0, mn.TOKENS: 7}
