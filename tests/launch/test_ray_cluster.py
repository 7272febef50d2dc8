"""The Ray engine on a real two-node Ray cluster on this host (two raylets, 1 CPU each:
``tests/support/ray_local.py``), and its faults.

- SFT and DPO on the cluster equal the same recipes under torchrun (the suite's runs,
  tests/conftest.py: every ``moe/`` and
  ``train_perf/`` key but the timed ones, the store's counts, the expert tables), with one
  actor per node through the placement group (``STRICT_SPREAD``) and each rank's node in
  ``run.json``;
- a cluster without the CPUs the ranks ask for is refused before any actor starts;
- ``examples/integrate_ray.py`` (a framework's own driver) runs on the cluster;
- the fault chain (SFT): an actor killed by ``kill -9`` ends the run naming its rank,
  node and how it died, while a second run of the live directory is refused; SIGTERM of a
  driver that started its own embedded Ray stops every actor and every Ray process it started
  (checked by process list); the resumed driver then trains to the end with every step exactly
  once in ``metrics.jsonl`` and the store.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_local import LocalRayCluster, named, ray_env, still_running

from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path
from tests.launch.test_ray_driver import assert_same_numbers, rows

pytestmark = [
    pytest.mark.one_line,
    pytest.mark.xdist_group("shared_runs"),
]  # as tests/launch/test_ray_driver.py

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = ROOT / "examples" / "configs"

QUIET = ["logger.wandb_enabled=false", "logger.tensorboard_enabled=false"]

STEPS = 2  # as the torchrun runs of tests/conftest.py

LONG = 400  # steps the interrupted runs of the fault chain ask for (they never get there)


def _env(base: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(base / "home"), "COLUMNS": "160"}
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    (base / "home").mkdir(parents=True, exist_ok=True)
    return env


def _wait_for(predicate, proc: subprocess.Popen, timeout_s: float = 240, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before {what}: {proc.stdout.read()}")
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes (head + one worker node), 1 CPU each, stopped after the module."""
    ray_cluster = LocalRayCluster(tmp_path_factory.mktemp("ray_cluster"), nodes=2, cpus=1)
    ray_cluster.start()
    yield ray_cluster
    ray_cluster.stop()


def _driver(cluster: LocalRayCluster | None, recipe: str, root: Path, *args: str, popen=False):
    """The Ray driver (``python -m nemo_moe_metrics.launch.ray_driver``) on the cluster (or an
    embedded Ray when ``cluster`` is None)."""
    cmd = [sys.executable, "-m", "nemo_moe_metrics.launch.ray_driver", str(CONFIGS / recipe),
           "--nproc", "2", "--output-dir", str(root), *args]  # fmt: skip
    env = _env(root.parent, **(cluster.env if cluster else {}))
    if popen:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)


# The torchrun runs the suite makes anyway (tests/conftest.py), and the same recipes on Ray.
SAME_AS = {
    "sft": ("sft_torchrun_run", ["policy.model.moe_layer_freq=[0,1,1,1]"]),
    "dpo": ("dpo_torchrun_run", ["policy.megatron_cfg.moe_per_layer_logging=true"]),
}


@pytest.fixture(scope="module", params=["sft", "dpo"])
def same_recipe_both_engines(request, cluster, tmp_path_factory):
    algo = request.param
    fixture, overrides = SAME_AS[algo]
    proc, reference, _ = request.getfixturevalue(fixture)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    base = tmp_path_factory.mktemp(f"ray_{algo}")
    args = (f"training.max_steps={STEPS}", *overrides, *QUIET)
    proc = _driver(cluster, f"{algo}_moe_tiny.yaml", base / "ray", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return algo, base / "ray" / f"{algo}_moe_tiny", reference


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_and_dpo_on_two_ray_nodes_equal_the_torchrun_runs(same_recipe_both_engines):
    algo, ray_dir, reference = same_recipe_both_engines
    compared = assert_same_numbers(ray_dir, reference, steps=STEPS)
    assert compared >= 15, compared  # moe/ balance and aux losses, train_perf/ tokens and FLOPs
    for mine, theirs in zip(rows(ray_dir), rows(reference), strict=True):
        assert mine["train/loss"] == theirs["train/loss"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_actor_per_node_through_the_placement_group_and_nodes_in_run_json(
    same_recipe_both_engines,
):
    _, ray_dir, _ = same_recipe_both_engines
    meta = json.loads((ray_dir / "run.json").read_text())["ray"]
    assert meta["strategy"] == "STRICT_SPREAD" and meta["embedded"] is False
    assert meta["nodes"] == 2
    ranks = meta["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["node_id"] for r in ranks}) == 2  # each rank on its own raylet
    assert all(r["node_ip"] for r in ranks)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_without_the_cpus_is_refused_before_any_actor_starts(cluster, tmp_path):
    proc = _driver(cluster, "sft_moe_tiny.yaml", tmp_path / "runs", *QUIET, "--nproc", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert re.match(
        rf"error: the Ray cluster at [\d.]+:{cluster.port} cannot hold 4 ranks of 1 CPU each: "
        r"its 2 node\(s\) \(",
        line,
    ), line
    assert "hold 2, 2 missing. Lower --nproc to 2" in line
    assert not (tmp_path / "runs").exists()  # refused before the run directory was touched


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frameworks_own_driver_merges_its_workers_results_on_the_cluster(cluster, tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/integrate_ray.py", "--out", str(tmp_path / "run"),
         "--steps", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=400,
        env=_env(tmp_path, **cluster.env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = rows(tmp_path / "run")
    assert [r["step"] for r in logged] == [0, 1]
    for row in logged:
        assert row["moe/max_over_ideal"] >= 1 and row["train_perf/tokens"] > 0
        assert row["driver/step_seconds"] > 0
    assert [s for s, _, _ in read_expert_loads(store_path(tmp_path / "run"))] == [0, 1]
    assert "run integrate_ray: steps 0–1 (2 logged)" in proc.stdout


def _run_cli(cluster, out: Path, *args: str, steps: int = LONG, popen: bool = True):
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(CONFIGS / "sft_moe_tiny.yaml"),
           f"training.max_steps={steps}", "logger.table_every=1", *QUIET, "--engine", "ray",
           "--ray-address", cluster.address, "--output-dir", str(out), *args]  # fmt: skip
    env = _env(out.parent, **ray_env(cluster.env["RAY_AUTH_TOKEN"]))
    if not popen:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def _logged(run_dir: Path) -> list[int]:
    try:
        return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError, KeyError):
        return []


def _ranks(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "run.json").read_text())["ray"]["ranks"]
    except (OSError, ValueError, KeyError):
        return []


@pytest.fixture(scope="module")
def chain(cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("ray_faults")
    out, run_dir = base / "runs", base / "runs" / "sft_moe_tiny"
    seen: dict = {}
    # 1. A fresh run on the cluster; kill -9 of rank 1's actor after its first step.
    job = _run_cli(cluster, out)
    _wait_for(lambda: _logged(run_dir) and len(_ranks(run_dir)) == 2, job, what="a step")
    seen["second"] = _run_cli(cluster, out, popen=False)  # the lock: refused, naming the holder
    victim = _ranks(run_dir)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    seen["killed"] = {"victim": victim, "status": job.wait(timeout=300), "said": job.stdout.read()}
    seen["after_kill"] = _logged(run_dir)
    # 2. The driver alone (as a Slurm job runs it) with its own embedded Ray; SIGTERM to it.
    before = len(_logged(run_dir))
    driver = _driver(None, "sft_moe_tiny.yaml", out, f"training.max_steps={LONG}",
                     "logger.table_every=1", *QUIET, "logger.resume=true", popen=True)  # fmt: skip
    _wait_for(lambda: len(_logged(run_dir)) > before, driver, what="a resumed step")
    snapshot = named([driver.pid, *processes.descendants(driver.pid)])
    driver.send_signal(signal.SIGTERM)
    seen["sigterm"] = {"status": driver.wait(timeout=120), "said": driver.stdout.read()}
    seen["sigterm"]["snapshot"] = snapshot
    deadline = time.monotonic() + 20
    while still_running(snapshot) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen["sigterm"]["left"] = still_running(snapshot)
    # 3. The driver alone on the cluster continues the run, two more steps, to the end (as a
    # resubmitted Slurm job does; `run --resume` passes the driver the same logger.resume).
    seen["max_steps"] = len(_logged(run_dir)) + 2
    seen["resumed"] = _driver(cluster, "sft_moe_tiny.yaml", out, "logger.table_every=1",
                              f"training.max_steps={seen['max_steps']}", *QUIET,
                              "logger.resume=true")  # fmt: skip
    seen["run_dir"] = run_dir
    return seen


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_actor_ends_the_run_naming_its_rank_node_and_death(chain):
    killed = chain["killed"]
    assert killed["status"] == 1, killed["said"][-3000:]
    victim = killed["victim"]
    lines = killed["said"].splitlines()
    i = lines.index("run failed (exit 1)")
    assert lines[i + 1].startswith(
        f"rank 1 died (actor pid {victim['pid']} on node {victim['host']} {victim['node_ip']}, "
        f"node id {victim['node_id'][:12]}): its process ended without a Python error (killed "
        "by a signal such as kill -9"
    ), lines[i + 1]
    steps = chain["after_kill"]
    assert steps and steps == list(range(len(steps)))  # every finished step kept, in order


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_run_of_a_live_ray_run_is_refused_naming_it(chain):
    second = chain["second"]
    assert second.returncode == 2, second.stdout + second.stderr
    assert "sft_moe_tiny is in use by another run: nemo-moe-metrics run " in second.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_of_a_driver_stops_its_actors_and_the_ray_it_started(chain):
    stopped = chain["sigterm"]
    assert stopped["status"] == 143, stopped["said"][-3000:]
    assert "driver: SIGTERM: stopped every actor" in stopped["said"]
    kinds = [name for _, name in stopped["snapshot"].values()]
    assert "raylet" in kinds and "gcs_server" in kinds, kinds
    assert sum(name.startswith("ray::") for name in kinds) >= 2, kinds
    assert stopped["left"] == [], stopped["left"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_after_the_faults_trains_every_step_exactly_once(chain):
    resumed = chain["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    run_dir, max_steps = chain["run_dir"], chain["max_steps"]
    assert _logged(run_dir) == list(range(max_steps))
    assert [s for s, _, _ in read_expert_loads(store_path(run_dir))] == list(range(max_steps))
    meta = json.loads((run_dir / "run.json").read_text())
    assert len(meta["resumed"]) == 2 and len(meta["ray"]["earlier"]) == 2


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
