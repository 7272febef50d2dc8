"""A child process of tests/test_trl.py's trackio tests (trackio reads its store folder once,
at import): ``sink`` trains with the callback's own trackio sink (``logger.trackio_enabled``),
``report_to`` with the Trainer's ``report_to="trackio"``; both read the store back through
trackio's own API and print it as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_tiny as tt  # noqa: E402

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback  # noqa: E402


def main(mode: str, out: Path) -> None:
    """Train 2 steps; print ``{"history": ..., "trackio": [rows]}``."""
    flags = MetricsConfig(track_moe_metrics=True, track_throughput=True)
    model_dir = tt.save_tiny_model(out / "model")
    if mode == "sink":
        logger = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, trackio_enabled=True)
        callback = MoEMetricsCallback(flags, run_dir=out / "run", logger=logger)
        trainer = tt.build_trainer("sft", model_dir, out / "trainer", [callback], max_steps=2,
                                   run_name="tiny_sft")  # fmt: skip
    else:
        callback = MoEMetricsCallback(flags)
        trainer = tt.build_trainer("sft", model_dir, out / "trainer", [callback], max_steps=2,
                                   report_to=["trackio"], run_name="tiny_sft")  # fmt: skip
    trainer.train()
    from trackio.sqlite_storage import SQLiteStorage

    project = "nemo_moe_metrics" if mode == "sink" else None
    if project is None:  # transformers' default trackio project
        project = next(p for p in SQLiteStorage.get_projects())
    rows = SQLiteStorage.get_logs(project, "tiny_sft")
    history = [h for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"history": history, "trackio": rows}, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
