"""The Ray engine: the README's main job with ``--engine ray`` on an embedded local Ray equals
the torchrun run (the session's ``main_job_run``) key for key; ``report`` reads it; nothing of
Ray is left running after it; and the parts that need no cluster (placement plans, the merge of
worker results, the expert table's trip through the object store, the CLI's refusals)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ray_local import named, still_running

from nemo_moe_metrics.export import metric_names as names
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

# The CLI, Ray and the driver's merge: what they check does not depend on the megatron-core
# line (the actors run the same worker the torchrun tests run on both lines).
pytestmark = [pytest.mark.one_line, pytest.mark.xdist_group("shared_runs")]

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"

# Values that depend on the wall clock; every other key must equal the torchrun run's.
TIMED = {
    names.SECONDS,
    names.TOTAL_SECONDS,
    names.TOKENS_PER_SECOND,
    names.CUMULATIVE_TOKENS_PER_SECOND,
    names.ESTIMATED_FLOPS_PER_SECOND,
    names.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND,
    names.TFLOPS_PER_GPU,
    names.MFU,
}


def rows(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_numbers(ray_dir: Path, torchrun_dir: Path, steps: int) -> int:
    """Every ``moe/`` and ``train_perf/`` key (times aside), the store's counts and the expert
    tables are equal, bit for bit; the number of keys compared per step."""
    got, want = rows(ray_dir), rows(torchrun_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(steps))
    compared = 0
    for mine, theirs in zip(got, want, strict=True):
        families = {k for k in theirs if k.startswith(("moe/", "train_perf/"))} - TIMED
        # The driver adds its own keys; it drops none of the workers'.
        assert set(mine) - set(theirs) <= set(names.DRIVER_KEYS), set(mine) ^ set(theirs)
        assert set(theirs) <= set(mine), set(theirs) - set(mine)
        for key in sorted(families):
            assert mine[key] == theirs[key], (mine["step"], key, mine[key], theirs[key])
        compared = len(families)
    stored = list(read_expert_loads(store_path(ray_dir)))
    expected = list(read_expert_loads(store_path(torchrun_dir)))
    assert [s for s, _, _ in stored] == [s for s, _, _ in expected] == list(range(steps))
    for (_, ids, counts), (_, ids_ref, counts_ref) in zip(stored, expected, strict=True):
        assert np.array_equal(ids, ids_ref) and np.array_equal(counts, counts_ref)
    return compared


def watch_processes(proc: subprocess.Popen, every_s: float = 0.3) -> dict:
    """Poll the processes below ``proc`` until it ends: the process-list snapshot of all."""
    seen: dict = {}
    while proc.poll() is None:
        seen.update(named(processes.descendants(proc.pid)))
        time.sleep(every_s)
    return seen


@pytest.fixture(scope="module")
def ray_main_job(tmp_path_factory):
    """``nemo-moe-metrics run examples/configs/grpo_moe_tiny.yaml --engine ray`` (3 steps, as
    the session's torchrun main job), every process below it recorded while it ran."""
    base = tmp_path_factory.mktemp("ray_main_job")
    (base / "home").mkdir()
    env = {**os.environ, "HOME": str(base / "home"), "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(GRPO), "training.max_steps=3"]
    cmd += ["--engine", "ray", "--output-dir", str(base / "runs")]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    seen = watch_processes(proc)
    out, _ = proc.communicate(timeout=400)
    return {"status": proc.returncode, "out": out, "seen": seen, "base": base}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_main_job_equals_the_torchrun_main_job(ray_main_job, main_job_run):
    assert ray_main_job["status"] == 0, ray_main_job["out"][-4000:]
    run_dir = ray_main_job["base"] / "runs" / "grpo_moe_tiny"
    compared = assert_same_numbers(run_dir, main_job_run, steps=3)
    assert compared > 60  # every moe/ family of the recipe, per layer, and train_perf/
    # The loop's own keys too, on CPU (the issue allows these to differ in rounding).
    for mine, theirs in zip(rows(run_dir), rows(main_job_run), strict=True):
        assert mine[names.TRAIN_REWARD] == pytest.approx(theirs[names.TRAIN_REWARD], rel=1e-12)
        assert mine[names.TRAIN_LOSS] == theirs[names.TRAIN_LOSS]
        assert mine[names.DRIVER_STEP_SECONDS] >= mine[names.DRIVER_TRAIN_SECONDS] > 0
        assert mine[names.DRIVER_GENERATE_SECONDS] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_main_job_records_each_ranks_actor_and_node_and_report_reads_it(ray_main_job):
    run_dir = ray_main_job["base"] / "runs" / "grpo_moe_tiny"
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["engine"] == "ray" and meta["ray"]["embedded"] is True
    assert meta["ray"]["strategy"] == "PACK" and meta["ray"]["nodes"] == 1
    ranks = meta["ray"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["dp_rank"] for r in ranks] == [0, 1]
    assert all(r["node_id"] and r["node_ip"] and r["pid"] for r in ranks)
    assert "engine: ray" in (run_dir / "recipe.yaml").read_text()
    # run ended with the report of the run directory (render_report, as `report` runs it).
    out = ray_main_job["out"]
    assert "run grpo_moe_tiny: steps 0–2 (3 logged)" in out
    assert "expert load over step 2: max/ideal mean" in out
    assert f"wrote {run_dir / 'expert_load_heatmap.png'}" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_main_job_leaves_no_ray_process_and_nothing_in_home(ray_main_job):
    seen = ray_main_job["seen"]
    kinds = [name for _, name in seen.values()]
    # The embedded Ray was seen while it ran: its GCS, its raylet and the two actors.
    assert "gcs_server" in kinds and "raylet" in kinds, kinds
    assert sum(name.startswith("ray::") for name in kinds) >= 2, kinds
    assert still_running(seen) == []
    home = ray_main_job["base"] / "home"
    assert not (home / ".ray").exists()  # Ray's token lived in the environment only


def test_ray_address_without_the_ray_engine_is_refused_before_anything_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(GRPO), "--ray-address",
         "10.0.0.1:6379", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "error: --ray-address 10.0.0.1:6379 names a Ray cluster, but the engine is torchrun: "
        "add --engine ray"
    )
    assert not list(tmp_path.iterdir())
