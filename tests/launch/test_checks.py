"""What run checks before any process starts (launch/checks.py): a rerun of a run that failed
before logging, and a resume with no step left to train, each said in a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import cli_in_clean_home

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


def test_a_run_that_failed_before_logging_does_not_block_the_cli_rerun(tmp_path):
    from nemo_moe_metrics.launch import prepare_run_dir
    from nemo_moe_metrics.run_dir import RunDirLock

    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    # What a run that failed early leaves: its lock (the mark of a run), logs, no step.
    lock = RunDirLock(run_dir, command="nemo-moe-metrics run grpo_moe_tiny.yaml").acquire()
    lock.mark_run()
    lock.release()
    (run_dir / "nemo_run" / "experiments").mkdir(parents=True)
    (run_dir / "launch.log").write_text("Traceback ...\n")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "run.json").write_text("{}")
    with RunDirLock(run_dir) as lock:
        note = prepare_run_dir(run_dir, earlier_lock=lock.previous)
    assert note == (
        f"{run_dir}: the earlier run there logged no step (it failed early); starting afresh"
    )
    assert [p.name for p in run_dir.iterdir()] == [".run.lock"]
    # With a logged step it is a run again: refused as before.
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(Exception, match="already holds a run"):
        prepare_run_dir(run_dir)


def test_resume_of_a_run_that_logged_no_step_says_so(tmp_path):
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "launch.log").write_text("Traceback ...\n")
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert f"--resume: {run_dir} holds a run that logged no step; drop --resume" in proc.stderr


# --------------------------------------------------------------------------- 4. resume finished


def test_resume_of_a_finished_run_says_it_is_at_max_steps_and_how_to_extend(tmp_path):
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "train/loss": 0.0} for s in range(8)]  # the recipe's max_steps is 8
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in run_dir.iterdir())
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"--resume: {run_dir} is already at training.max_steps=8 (last logged step 7)"
        in proc.stderr
    )
    assert f"nemo-moe-metrics run {GRPO} training.max_steps=16 --resume" in proc.stderr
    assert "starting ranks" not in proc.stdout
    after = sorted(p.name for p in run_dir.iterdir() if p.name != ".run.lock")  # the lock stays
    assert after == before, "nothing launched or redrawn"
