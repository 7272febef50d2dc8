"""Launching through nemo-run: local torchrun end to end, the Slurm dry run, and CLI errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_moe_metrics.config import load_recipe
from nemo_moe_metrics.export import metric_names as names
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"
DPO = ROOT / "examples" / "configs" / "dpo_moe_tiny.yaml"


def _cli(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def launch_recipe(tmp_path, recipe, *overrides, script=None):
    """``nemo-moe-metrics run`` on 2 ranks; with ``script`` (a file in recipes/) that script."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    args = [str(recipe), "training.max_steps=2", *overrides, "--nproc", "2"]
    args += ["--output-dir", str(tmp_path / "runs")]
    if script is None:
        proc = _cli("run", *args, env=env)
    else:  # as docs/en/training_loops.md runs it: python recipes/local_torchrun.py RECIPE ...
        proc = subprocess.run(
            [sys.executable, script, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, home


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_counts_match_training_tokens(run_dir, rows, topk=2, moe_layers=(1, 2, 3)):
    # Independent of the expert-load code path: the throughput meter counts the real tokens of
    # the training microbatches from the batch itself. Every training token is routed to top-k
    # experts in every MoE layer; reference, rollout and scoring forwards must add nothing.
    # The counts live in the expert-load store; metrics.jsonl holds scalars only.
    assert not [r["step"] for r in rows if names.EXPERT_LOADS in r]
    tokens = {r["step"]: r[names.TOKENS] for r in rows}
    stored = list(read_expert_loads(store_path(run_dir)))
    assert [step for step, _, _ in stored] == [r["step"] for r in rows]  # recipes: table_every 1
    for step, layer_ids, counts in stored:
        assert layer_ids.tolist() == list(moe_layers)
        expected = tokens[step] * topk
        assert expected > 0
        assert counts.sum(axis=1).tolist() == [expected] * len(moe_layers), step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_two_torchrun_ranks_writes_every_metric_and_artifact(tmp_path):
    # The recipe logs per layer (every metric on); this run checks the switch turns them off.
    proc, home = launch_recipe(tmp_path, GRPO, "policy.megatron_cfg.moe_per_layer_logging=false")
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["train/loss"]) and 0 <= r["train/reward"] <= 1 for r in rows)
    assert all(r["train/num_microbatches"] == 4 for r in rows)
    # The global batch, as NeMo RL and Megatron count it: both data-parallel ranks together.
    gbs = load_recipe(GRPO).policy.train_global_batch_size
    assert [r["train/num_sequences"] for r in rows] == [gbs, gbs] and gbs == 2 * 4 * 2
    for row in rows:
        for key in (names.aux_loss_key("load_balancing_loss"), names.aux_loss_key("z_loss")):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert set(names.BALANCE_SUMMARY_KEYS) <= set(row)
        assert set(names.THROUGHPUT_KEYS) <= set(row)
        # CPU: FLOPs and TFLOP/s yes, MFU no (no known peak).
        assert set(names.FLOPS_KEYS) - {names.MFU} <= set(row) and names.MFU not in row
        # Per-layer keys only with moe_per_layer_logging, and never a doubled prefix.
        assert not [k for k in row if "_layer_" in k or k.startswith("moe/layer_")]
        assert not [k for k in row if k.startswith("moe/moe/") or "/moe/" in k]
    check_counts_match_training_tokens(run_dir, rows)
    # The recipe in the run directory is the one that ran, override included.
    assert "max_steps: 2" in (run_dir / "recipe.yaml").read_text()
    for artifact in ("expert_load_heatmap.png", "max_over_ideal.png"):
        assert (run_dir / artifact).stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    # The progress bar reached the last step; the summary names the run and its balance.
    assert "2/2" in proc.stdout and str(run_dir) in proc.stdout and "max/ideal" in proc.stdout
    # nemo-run kept its state inside the run directory, not in the home directory.
    assert (run_dir / "nemo_run" / "experiments").is_dir()
    assert not (home / ".nemo_run").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dpo_per_layer_logging_and_reference_forwards_not_counted(dpo_torchrun_run):
    # Through recipes/local_torchrun.py, the script docs/en/training_loops.md shows (the run
    # is conftest.py's: tests/launch/test_ray_cluster.py compares the Ray engine's DPO with it).
    proc, run_dir, _ = dpo_torchrun_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        for layer in (1, 2, 3):
            assert names.aux_loss_layer_key("load_balancing_loss", layer) in row
            assert names.layer_stat_key(layer, "max_over_ideal") in row
        # The dense first layer has no MoE values.
        assert names.aux_loss_layer_key("load_balancing_loss", 0) not in row
        assert names.layer_stat_key(0, "max_over_ideal") not in row
    check_counts_match_training_tokens(run_dir, rows)


def test_slurm_recipe_dry_run_shows_sbatch_and_torchrun_command(tmp_path):
    # A subprocess, as a user runs it (nemo-run's local tunnel reads stdin, which pytest owns).
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/slurm.py",
            "examples/configs/grpo_moe_tiny.yaml",
            "training.max_steps=2",
            "policy.train_global_batch_size=64",  # the global batch of 16 ranks (a group each)
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
    text = proc.stdout.replace(" \\\n    ", " ")  # long commands are folded with continuations
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
    assert "--nproc 3 does not fit" in proc.stderr and "expert_model_parallel_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "grpo_moe_tiny").exists(), "nothing launched"


def test_run_reports_recipe_typo_before_launching(tmp_path):
    proc = _cli("run", str(GRPO), "training.max_step=2", "--output-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "did you mean 'max_steps'" in proc.stderr


def test_rank_error_line_is_found_in_a_torchrun_log(tmp_path):
    from nemo_moe_metrics.launch import first_rank_failure

    log = tmp_path / "combined.log"
    log.write_text(
        "[default0]:Traceback (most recent call last):\n"
        "[default0]:    raise ValueError(\n"
        "[default0]:ValueError: set pipeline_model_parallel_size=1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert first_rank_failure(log).exception == "ValueError: set pipeline_model_parallel_size=1"


def test_describe_step_shows_loss_and_skips_missing_fields():
    from nemo_moe_metrics.launch import describe_step

    assert describe_step({"step": 0, "train/loss": 1.23456}) == "loss 1.2346"
    assert describe_step({"step": 0}) == ""
    assert describe_step({"train/loss": 0.0, "train/reward": 0.25}) == "loss 0.0000  reward 0.250"
    row = {names.TOKENS_PER_SECOND: 812.4, names.MAX_OVER_IDEAL: 1.234}
    assert describe_step(row) == "tok/s 812  max/ideal 1.23"
