"""run.json (run_dir/run_json.py): the model's shape recorded when the sinks are built."""

import json

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.sinks import RUN_FILE, build_sinks

JSONL_ONLY = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)


def test_build_sinks_records_the_model_shape_in_run_json(tmp_path):
    config = {"policy": {"model": {"num_layers": 6, "num_experts": 32, "moe_router_topk": 4}}}
    build_sinks(JSONL_ONLY, tmp_path, run_name="tiny-moe", config=config).close()
    meta = json.loads((tmp_path / RUN_FILE).read_text())
    assert (meta["run_name"], meta["num_layers"], meta["num_experts"], meta["moe_router_topk"]) == (
        "tiny-moe",
        6,
        32,
        4,
    )
    assert meta["config"] == config
