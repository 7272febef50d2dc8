"""Launching through nemo-run: local torchrun end to end, the Slurm dry run, and CLI errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


def _cli(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_two_torchrun_ranks_expert_parallel_writes_one_line_per_step(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = _cli(
        "run",
        str(GRPO),
        "training.max_steps=2",
        "--nproc",
        "2",
        "--output-dir",
        str(tmp_path / "runs"),
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["train/loss"]) and 0 <= r["train/reward"] <= 1 for r in rows)
    assert all(r["train/num_microbatches"] == 4 for r in rows)
    # The recipe in the run directory is the one that ran, override included.
    assert "max_steps: 2" in (run_dir / "recipe.yaml").read_text()
    # The progress bar reached the last step and the summary names the run directory.
    assert "2/2" in proc.stdout and str(run_dir) in proc.stdout
    # nemo-run kept its state inside the run directory, nothing in the home directory.
    assert (run_dir / "nemo_run" / "experiments").is_dir()
    assert list(home.iterdir()) == []


def test_slurm_recipe_dry_run_shows_sbatch_and_torchrun_command(tmp_path):
    # A subprocess, as a user runs it (nemo-run's local tunnel reads stdin, which pytest owns).
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/slurm.py",
            "examples/configs/grpo_moe_tiny.yaml",
            "training.max_steps=2",
            "--account=my_account",
            "--partition=gpu",
            "--nodes=2",
            "--gpus-per-node=8",
            "--container-image=nvcr.io/nvidia/nemo:25.09",
            f"--output-dir={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for expected in (
        "#SBATCH --account=my_account",
        "#SBATCH --partition=gpu",
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "--container-image nvcr.io/nvidia/nemo:25.09",
        "--nnodes 2 --nproc-per-node 8",
        "-m nemo_moe_metrics.train --recipe examples/configs/grpo_moe_tiny.yaml",
        "training.max_steps=2",
    ):
        assert expected in text, expected
    assert "torchrun" in text


def test_run_rejects_nproc_that_does_not_fit_expert_parallel(tmp_path):
    proc = _cli("run", str(GRPO), "--nproc", "3", "--output-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "--nproc 3 does not fit" in proc.stderr and "expert 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "grpo_moe_tiny").exists(), "nothing launched"


def test_run_reports_recipe_typo_before_launching(tmp_path):
    proc = _cli("run", str(GRPO), "training.max_step=2", "--output-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "did you mean 'max_steps'" in proc.stderr


def test_rank_error_line_is_found_in_a_torchrun_log(tmp_path):
    from nemo_moe_metrics.launch import _first_rank_error

    log = tmp_path / "combined.log"
    log.write_text(
        "[default0]:Traceback (most recent call last):\n"
        "[default0]:    raise ValueError(\n"
        "[default0]:ValueError: set pipeline_model_parallel_size=1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert _first_rank_error(log) == "ValueError: set pipeline_model_parallel_size=1"


def test_describe_step_shows_loss_and_skips_missing_fields():
    from nemo_moe_metrics.launch import describe_step

    assert describe_step({"step": 0, "train/loss": 1.23456}) == "loss 1.2346"
    assert describe_step({"step": 0}) == ""
    assert describe_step({"train/loss": 0.0, "train/reward": 0.25}) == "loss 0.0000  reward 0.250"


def test_jsonl_writer_flushes_each_step_and_converts_tensors(tmp_path):
    import torch

    from nemo_moe_metrics.train import JsonlWriter

    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer.log({"a": torch.tensor(1.5), "t": [[0, 1, 2, 50.0]], "n": float("nan")}, 0)
    # Readable before close: a tailing progress bar sees each step as it lands.
    row = json.loads((tmp_path / "m.jsonl").read_text())
    writer.close()
    assert row == {"step": 0, "a": 1.5, "t": [[0, 1, 2, 50.0]], "n": None}
