"""The Ray engine: the README's main job with ``--engine ray`` on an embedded local Ray equals
the torchrun run (the session's ``main_job_run``) key for key; ``report`` reads it; nothing of
Ray is left running after it; and the parts that need no cluster (placement plans, the merge of
worker results, the expert table's trip through the object store, the CLI's refusals)."""

from __future__ import annotations

import json
import os
import pickle
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
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parent.parent
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


# --------------------------------------------------------------------------- no cluster


def _node(i: int, cpus: float = 1, gpus: float = 0) -> dict:
    return {"node_id": f"n{i}", "node_ip": f"10.0.0.{i}", "CPU": float(cpus), "GPU": float(gpus)}


def test_one_rank_per_node_where_there_are_several_nodes_else_ranks_packed():
    from nemo_moe_metrics.launch.ray_cluster import plan_placement

    two = plan_placement(2, "h:1", [_node(1), _node(2)])
    assert (two.strategy, two.use_gpu, two.bundle) == ("STRICT_SPREAD", False, {"CPU": 1.0})
    assert plan_placement(2, "h:1", [_node(1, cpus=2)]).strategy == "PACK"
    # 16 GPU ranks on 2 nodes of 8: packed, a node's ranks together.
    gpus = plan_placement(16, "h:1", [_node(1, 64, 8), _node(2, 64, 8)])
    assert (gpus.strategy, gpus.bundle) == ("PACK", {"CPU": 1.0, "GPU": 1.0})


def test_a_cluster_too_small_is_refused_naming_what_is_missing():
    from nemo_moe_metrics.config import ConfigError
    from nemo_moe_metrics.launch.ray_cluster import plan_placement

    with pytest.raises(ConfigError) as err:
        plan_placement(4, "10.0.0.1:6379", [_node(1), _node(2)])
    text = str(err.value)
    assert text.startswith("the Ray cluster at 10.0.0.1:6379 cannot hold 4 ranks of 1 CPU each")
    assert "(10.0.0.1 1 CPU, 10.0.0.2 1 CPU) hold 2, 2 missing" in text
    assert "Lower --nproc to 2" in text and "ray start --address 10.0.0.1:6379" in text
    with pytest.raises(ConfigError, match="ranks of 1 GPU and 1 CPU each.*hold 3, 1 missing"):
        plan_placement(4, "h:1", [_node(1, 8, 2), _node(2, 8, 1)])


def test_the_merge_takes_the_groups_dict_once_and_refuses_mixed_results():
    from nemo_moe_metrics.worker.results import (
        WorkerResult,
        log_worker_results,
        merge_worker_results,
        worker_result,
    )

    step = {"moe/max_over_ideal": 1.5, "train_perf/tokens": 96}
    # Rank 0 sends the dict, the others its keys' digest (one copy crosses to the driver).
    results = [worker_result(step, step=4, rank=r, node="n") for r in (1, 0)]
    assert [bool(r.metrics) for r in results] == [False, True]
    assert merge_worker_results(results, {"train/reward": 0.5}) == {**step, "train/reward": 0.5}
    logged = []

    class Sink:
        def log(self, metrics, at):
            logged.append((at, metrics))

    log_worker_results(results, Sink())
    assert logged == [(4, step)]
    with pytest.raises(ValueError, match="different steps"):
        merge_worker_results([WorkerResult(0, 4, step), WorkerResult(1, 5, step)])
    with pytest.raises(ValueError, match="rank 1 returned other keys than rank 0"):
        merge_worker_results([WorkerResult(0, 4, step), WorkerResult(1, 4, {"moe/x": 1})])
    other = worker_result({"moe/x": 1}, step=4, rank=1)  # a digest of other keys
    with pytest.raises(ValueError, match="rank 1 returned other keys than rank 0"):
        merge_worker_results([results[1], other])
    with pytest.raises(ValueError, match="none of ranks \\[1\\] sent its step dict"):
        merge_worker_results([results[0]])
    with pytest.raises(ValueError, match=r"both produced \['moe/max_over_ideal'\]"):
        merge_worker_results(results, {"moe/max_over_ideal": 2.0})
    with pytest.raises(ValueError, match="no worker results"):
        merge_worker_results([])


def test_the_expert_table_crosses_a_pickle_as_its_arrays_never_its_rows():
    from nemo_moe_metrics.export.expert_table import ExpertTable

    table = ExpertTable(np.arange(94), np.random.default_rng(0).integers(0, 999, (94, 256)))
    arrays = len(pickle.dumps(table))
    assert len(table.rows) == 94 * 256  # the rows view, built once the sinks ask for it
    assert len(pickle.dumps(table)) == arrays < 94 * 256 * 8 + 4096
    back = pickle.loads(pickle.dumps(table))
    assert back == table and back.rows == table.rows


def test_a_dead_actor_is_reported_as_its_rank_and_node_with_how_it_died(tmp_path, monkeypatch):
    from nemo_moe_metrics.launch.failures import LAST_WORDS_ENV, read_failures, record_rank_failure
    from nemo_moe_metrics.launch.ray_group import WorkerGroupError

    where = {"pid": 321, "host": "gpu7", "node_ip": "10.0.0.7", "node_id": "abcdef0123456789"}
    err = WorkerGroupError(1, where, "died", "its process ended without a Python error (in train)")
    assert str(err) == (
        "rank 1 (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345) died: its process "
        "ended without a Python error (in train)"
    )
    monkeypatch.setenv(LAST_WORDS_ENV, str(tmp_path / "words.jsonl"))
    record_rank_failure(err.recorded())
    raised = WorkerGroupError(0, where, "raised", "ValueError: bad", frame="x.py:3 in f")
    record_rank_failure(raised.recorded())
    first, second = read_failures(tmp_path / "words.jsonl")
    assert first.describe() == (
        "rank 1 died (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345): its process "
        "ended without a Python error (in train)"
    )
    assert second.describe().splitlines() == [
        "rank 0 raised ValueError: bad (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345)",
        "  at x.py:3 in f",
    ]


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


def test_importing_the_package_and_the_ray_engine_imports_no_ray():
    code = (
        "import sys, nemo_moe_metrics, nemo_moe_metrics.launch.ray_driver, "
        "nemo_moe_metrics.integrations.ray; print('ray' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stderr
