"""A child process of tests/integrations/test_transformers.py's trackio test (trackio reads its
store folder once, at import): one SFT run with both the callback's own trackio sink
(``logger.trackio_enabled``) and the Trainer's ``report_to="trackio"``, side by side in the run
directory's store; both are read back through trackio's own API and printed as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_tiny as tt  # noqa: E402

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback  # noqa: E402


def main(out: Path) -> None:
    """Train 2 steps with both; print ``{"history", "sink": rows, "report_to": rows}``."""
    flags = MetricsConfig(track_moe_metrics=True, track_throughput=True)
    model_dir = tt.save_tiny_model(out / "model")
    logger = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, trackio_enabled=True)
    callback = MoEMetricsCallback(flags, run_dir=out / "run", logger=logger)
    trainer = tt.build_trainer(
        "sft", model_dir, out / "trainer", [callback], max_steps=2, report_to=["trackio"],
        run_name="tiny_sft", project="hf_project",
    )  # fmt: skip
    trainer.train()
    from trackio.sqlite_storage import SQLiteStorage

    history = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "history": history,
        "sink": SQLiteStorage.get_logs("nemo_moe_metrics", "tiny_sft"),
        "report_to": SQLiteStorage.get_logs("hf_project", "tiny_sft"),
    }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
