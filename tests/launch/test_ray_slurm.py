"""Ray on Slurm for real: ``recipes/ray_slurm.py --submit --wait`` on the session's Slurm
controller (two slurmd nodes on this host, tests/support/slurm_cluster.py): a Ray head and a Ray
worker started through ``srun`` on the job's two nodes, the driver on the first, one actor per node;
the run equals the torchrun main job, ``report`` reads it, and no Ray process of the job is
left. Also the dry runs (the sbatch script; nemo-run's container form), which need no cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ray_local import ray_port

from tests.launch.test_ray_driver import assert_same_numbers

# Slurm, Ray and the CLI (tests/launch/test_slurm_job.py's reasoning)
pytestmark = [pytest.mark.one_line, pytest.mark.xdist_group("shared_runs")]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "examples/configs/grpo_moe_tiny.yaml"
CLUSTER = ("--account", "local", "--partition", "debug", "--gpus-per-node", "0")
# The job docs/*/ray.md shows (paths and ports aside): 2 nodes, one CPU rank (actor) each.
JOB = (RECIPE, "training.max_steps=3", *CLUSTER, "--nodes", "2", "--ranks-per-node", "1")


def _ray_slurm(env: dict[str, str], *args, timeout: float = 500) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "recipes/ray_slurm.py", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        timeout=timeout,
    )  # fmt: skip


def _gcs_processes(port: int) -> list[str]:
    """Processes of a Ray cluster whose head listens on ``port`` (GCS, raylets, agents)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        listens = f"--gcs_server_port={port}" in cmdline or f":{port} " in cmdline + " "
        if listens and "ray" in cmdline:
            found.append(f"{name} {cmdline[:120]}")
    return found


@pytest.fixture(scope="module")
def ray_job(slurm, tmp_path_factory):
    base = tmp_path_factory.mktemp("ray_slurm")
    (base / "home").mkdir()
    env = {**os.environ, **slurm.env, "HOME": str(base / "home"), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    port = ray_port()
    proc = _ray_slurm(
        env, *JOB, "--ray-port", port, "--output-dir", base / "runs", "--job-dir",
        base / "jobs", "--submit", "--wait",
    )  # fmt: skip
    return proc, base, port


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_on_two_slurm_nodes_equals_the_torchrun_main_job(ray_job, main_job_run):
    proc, base, _ = ray_job
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    job_id = re.search(r"^submitted Slurm job (\d+): grpo_moe_tiny with Ray on 2 node", proc.stdout,
                       re.M)  # fmt: skip
    assert job_id, proc.stdout
    assert f"job {job_id[1]} (grpo_moe_tiny): COMPLETED, ExitCode 0:0" in proc.stdout
    run_dir = base / "runs" / "grpo_moe_tiny"
    assert_same_numbers(run_dir, main_job_run, steps=3)
    meta = json.loads((run_dir / "run.json").read_text())["ray"]
    assert meta["embedded"] is False and meta["strategy"] == "STRICT_SPREAD"
    assert meta["nodes"] == 2 and len({r["node_id"] for r in meta["ranks"]}) == 2
    # The report of the run directory, printed at the end of --wait.
    assert "run grpo_moe_tiny: steps 0–2 (3 logged)" in proc.stdout
    # Slurm's and Ray's files are in the job directory, not in the run directory or home.
    [files] = (base / "jobs" / "ray").glob("grpo_moe_tiny_*")
    assert (files / f"sbatch_grpo_moe_tiny_{job_id[1]}.out").is_file()
    assert (
        "driver: 2 Ray actor(s) (STRICT_SPREAD, CPU) on 2 node(s)"
        in (files / f"log-grpo_moe_tiny_{job_id[1]}_0.out").read_text()
    )
    assert not (base / "home" / ".ray").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_jobs_ray_processes_end_with_it(ray_job):
    _, _, port = ray_job
    assert _gcs_processes(port) == []


def _dry_run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "recipes/ray_slurm.py", *args], capture_output=True, text=True,
        cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return re.sub(r" \\\n\s+", " ", proc.stdout)  # folded lines joined


def test_the_dry_run_starts_a_head_then_workers_then_the_driver():
    text = _dry_run(*JOB, "--ray-port", "6380")
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --cpus-per-task=1\n" in text
    head = text.index('ray start --head --node-ip-address="$head_ip" --port=6380 --num-cpus=1')
    worker = text.index('ray start --address="$RAY_ADDRESS" --num-cpus=1 --num-gpus=0')
    driver = text.index("python -m nemo_moe_metrics.launch.ray_driver ")
    assert head < worker < driver
    assert "--nproc 2 " in text[driver:] and "engine=ray" in text[driver:]
    assert "export RAY_AUTH_MODE=token\n" in text  # the job's own token, never on disk
    gpu = _dry_run(RECIPE, "policy.train_global_batch_size=64", "--account", "a", "--partition",
                   "p", "--nodes", "2")  # fmt: skip
    assert "#SBATCH --gpus-per-node=8\n" in gpu and "--num-gpus=8" in gpu
    assert "--nproc 16 " in gpu


def test_the_nemo_run_form_runs_every_ray_process_in_a_container():
    text = _dry_run(RECIPE, "policy.train_global_batch_size=64", "--account", "a", "--partition",
                    "p", "--nodes", "2", "--nemo-run", "--container-image",
                    "nvcr.io/nvidia/nemo:25.09")  # fmt: skip
    assert "--container-image=nvcr.io/nvidia/nemo:25.09" in text or "nvcr.io/nvidia/nemo" in text
    assert "--container-name=ray-head" in text
    assert "nemo_moe_metrics.launch.ray_driver" in text and "--ray-address auto" in text
