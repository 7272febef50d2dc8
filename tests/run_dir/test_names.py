"""Every name a run writes (run_dir/names.py): overwrite deletes every picture report draws, and
nothing of the user's."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.one_line  # CLI behaviour: the same on both megatron-core lines

REPO = Path(__file__).resolve().parents[2]


def test_build_sinks_overwrite_deletes_every_picture_report_draws_and_nothing_of_yours(tmp_path):
    import re

    from nemo_moe_metrics import LoggerConfig, build_sinks
    from nemo_moe_metrics.run_dir.names import PICTURES

    # Every picture name the report's source holds is one of run_files.PICTURES (one list).
    report_src = "\n".join(
        p.read_text() for p in (REPO / "nemo_moe_metrics" / "report").glob("*.py")
    )
    drawn = set(re.findall(r"\b(\w+\.png)\b", report_src))
    assert drawn <= set(PICTURES), drawn - set(PICTURES)
    # The sinks' own file names are run files too (what a run directory may hold).
    from nemo_moe_metrics.run_dir.names import RUN_FILES
    from nemo_moe_metrics.sinks import mlflow, store_format, trackio

    for name in (store_format.STORE_FILE, store_format.ROLLOUT_STORE_FILE, trackio.TRACKIO_DIR,
                 mlflow.MLFLOW_DB, mlflow.MLFLOW_ARTIFACTS_DIR):  # fmt: skip
        assert name in RUN_FILES, name

    cfg = LoggerConfig(wandb_enabled=False)
    sink = build_sinks(cfg, tmp_path, run_name="old")
    sink.log({"train/loss": 1.0}, 0)
    sink.close()
    old_pictures = ["expert_load_heatmap.png", "router_health.png", "routing_disagreement.png",
                    "expert_bias.png", "max_over_ideal.png"]  # fmt: skip
    for name in old_pictures:
        (tmp_path / name).write_bytes(b"an old run's picture")
    (tmp_path / "mine.txt").write_text("keep\n")
    build_sinks(cfg, tmp_path, run_name="new", overwrite=True).close()
    assert sorted(p.name for p in tmp_path.glob("*.png")) == []
    assert (tmp_path / "mine.txt").read_text() == "keep\n"
    assert (tmp_path / "metrics.jsonl").read_text() == ""
