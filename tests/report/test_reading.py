"""``report`` reads ``metrics.jsonl`` lines it did not write without a traceback and without
letting one line undo the others (through the real CLI): a line with a byte that is not UTF-8
is skipped and named; a line logging a negative step supersedes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hostile_files import fingerprint

from nemo_moe_metrics.cli import main
from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import build_sinks

pytestmark = pytest.mark.one_line


def _run(run_dir: Path) -> Path:
    """8 steps with throughput, an aux loss and per-layer max/ideal; no expert counts, so the
    report reads each line's per-layer keys (where a bad byte used to raise)."""
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    sink = build_sinks(cfg, run_dir, run_name="r")
    for step in range(8):
        sink.log(
            {
                mn.TOKENS: 8.0,
                mn.SECONDS: 1.0,
                mn.TOKENS_PER_SECOND: 8.0,
                mn.aux_loss_key("load_balancing_loss"): 0.25,
                "moe/layer_1/max_over_ideal": 1.5 + step / 10,
            },
            step,
        )
    sink.close()
    return run_dir


@pytest.mark.parametrize(
    "line,why",
    [
        (b'{"step":8,"moe/layer_1/max_over_ideal":2.0,"x":"\xff\xfe"}\n', "not UTF-8 text"),
        (b'{"step": -5}\n', "step -5 is outside 0..2**53-1"),
        (b'{"step":9007199254740993}\n', "step 9007199254740993 is outside"),
    ],
)
def test_a_foreign_line_is_skipped_named_and_undoes_nothing(tmp_path, capsys, line, why):
    run = _run(tmp_path / "run")
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(line)
    before = fingerprint(run)
    assert main(["report", str(run), "--out", str(tmp_path / "pictures")]) == 0
    out = capsys.readouterr().out
    assert f"skipped 1 unreadable line(s) (line 9: {why}" in out, out
    assert "superseded" not in out
    assert "steps 0–7 (8 logged)" in out
    assert "tokens/s" in out and "moe/load_balancing_loss 0.25" in out
    assert "throughput: not logged" not in out and "aux losses: not logged" not in out
    assert fingerprint(run) == before
    assert np.isfinite(float(out.split("moe/load_balancing_loss ")[1].split()[0]))


def test_report_reads_past_a_run_json_of_the_wrong_shape(tmp_path):
    import warnings

    from nemo_moe_metrics import LoggerConfig, build_sinks
    from nemo_moe_metrics.report import render_report

    sink = build_sinks(LoggerConfig(wandb_enabled=False), tmp_path, run_name="r")
    for step in range(2):
        rows = [[la, e, 10 + step + e, 1.0] for la in (1, 2) for e in range(4)]
        sink.log({"moe/expert_loads": rows, "train_perf/tokens": 8.0}, step)
    sink.close()
    for shape in ("[1, 2]", '"text"', '{"config": [1], "num_experts": "x"}', "null"):
        (tmp_path / "run.json").write_text(shape)
        (tmp_path / "pictures").mkdir(exist_ok=True)
        for old in (tmp_path / "pictures").iterdir():
            old.unlink()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            text = render_report(tmp_path, out_dir=tmp_path / "pictures")
        assert "is not a run record" in " ".join(str(w.message) for w in said), shape
        assert "r: 2 MoE layers × 4 experts" not in text  # the name came from the directory
        assert (tmp_path / "pictures" / "expert_load_heatmap.png").stat().st_size > 0
