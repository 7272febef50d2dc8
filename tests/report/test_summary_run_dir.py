"""Which run report reads (report/summary.py's resolve_run_dir): the metrics.jsonl file itself, a
folder of runs listed, a missing directory and an --out that is a file, each a clear line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_cli_ux import cli_in_clean_home

# --------------------------------------------------------------------------- 6. report paths


def _tiny_run(run_dir: Path, steps: int = 2) -> Path:
    run_dir.mkdir(parents=True)
    rows = [
        {"step": s, "train/loss": 1.0, "train_perf/tokens_per_second": 10.0} for s in range(steps)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_report_accepts_the_metrics_jsonl_file_itself(tmp_path):
    run_dir = _tiny_run(tmp_path / "runs" / "a")
    by_file = cli_in_clean_home(tmp_path, "report", run_dir / "metrics.jsonl")
    by_dir = cli_in_clean_home(tmp_path, "report", run_dir)
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_dir.stdout
    assert by_file.stdout.startswith("run a: steps 0–1 (2 logged)")


def test_report_on_a_folder_of_runs_lists_them(tmp_path):
    runs = tmp_path / "runs"
    for name in ("sft_moe_tiny", "grpo_moe_tiny"):
        _tiny_run(runs / name)
    proc = cli_in_clean_home(tmp_path, "report", runs)
    assert proc.returncode == 2
    assert f"error: {runs} is not a run directory (no metrics.jsonl); it holds 2 run(s)" in (
        proc.stderr
    )
    assert f"(e.g. nemo-moe-metrics report {runs / 'grpo_moe_tiny'})" in proc.stderr
    assert f"\n  {runs / 'sft_moe_tiny'}\n" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_on_a_missing_directory_says_it_does_not_exist(tmp_path):
    _tiny_run(tmp_path / "runs" / "grpo_moe_tiny")
    missing = tmp_path / "runs" / "grpo_moe_tny"
    proc = cli_in_clean_home(tmp_path, "report", missing)
    assert proc.returncode == 2
    assert (
        f"error: {missing} does not exist (no such directory); runs in {tmp_path / 'runs'}: "
        in (proc.stderr)
    )
    assert str(tmp_path / "runs" / "grpo_moe_tiny") in proc.stderr


def test_report_with_an_out_that_is_a_file_is_a_clear_error(tmp_path):
    run_dir = _tiny_run(tmp_path / "run")
    (tmp_path / "pictures").write_text("a file")
    proc = cli_in_clean_home(tmp_path, "report", run_dir, "--out", tmp_path / "pictures")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: cannot write the pictures into {tmp_path / 'pictures'}: it is a file, "
        "not a directory"
    )
    proc = cli_in_clean_home(tmp_path, "report", run_dir, "--out", tmp_path / "pictures" / "sub")
    assert proc.returncode == 2
    assert f"error: cannot write the pictures into {tmp_path / 'pictures' / 'sub'}: " in proc.stderr
    assert "Traceback" not in proc.stderr
