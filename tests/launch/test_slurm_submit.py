"""Submitting to Slurm (launch/slurm_submit.py, recipes/slurm.py): dry runs, and what is refused
before anything is submitted, in Slurm's words."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import clean_home_env
from tests.launch.test_slurm_job import slurm_py

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.xdist_group("shared_runs")  # the session's Slurm cluster


# --------------------------------------------------------------------------- 3. recipes/slurm.py


_SLURM_WITHOUT = """
import sys, importlib.abc, runpy
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = ["recipes/slurm.py", *sys.argv[1:]]
runpy.run_path("recipes/slurm.py", run_name="__main__")
"""


def _slurm(tmp_path, *args, blocked=(), path=None):
    env = clean_home_env(tmp_path)
    if path is not None:
        env["PATH"] = path
    code = _SLURM_WITHOUT.format(blocked=set(blocked))
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


# 8 GPUs: the global batch counts all 8 data-parallel ranks (README's Slurm line).
SLURM_ARGS = (
    "examples/configs/grpo_moe_tiny.yaml",
    "policy.train_global_batch_size=64",
    "--account=A",
    "--partition=P",
)


def test_slurm_without_the_launch_extra_names_it(tmp_path):
    proc = _slurm(tmp_path, *SLURM_ARGS, blocked={"nemo_run"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: recipes/slurm.py needs the 'launch' extra (nemo_run is not installed); "
        "install it with: pip install 'nemo_moe_metrics[launch]'"
    )


def test_slurm_submit_without_slurm_is_one_line(tmp_path):
    # A PATH without sbatch (CI installs Slurm, and /bin is /usr/bin on merged-/usr systems).
    (tmp_path / "bin").mkdir()
    proc = _slurm(
        tmp_path,
        *SLURM_ARGS,
        "--submit",
        f"--job-dir={tmp_path / 'jobs'}",
        path=str(tmp_path / "bin"),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node; "
        "without --submit this prints the sbatch command and script it would submit"
    )
    assert not (tmp_path / "jobs").exists()


def test_slurm_layout_errors_speak_slurm_options(tmp_path):
    proc = _slurm(tmp_path, *SLURM_ARGS, "--gpus-per-node", "3")
    assert proc.returncode == 2
    assert "--nodes 1 x --gpus-per-node 3 (3 GPUs) does not fit" in proc.stderr
    assert "use --gpus-per-node 2 (or a multiple of it)" in proc.stderr
    assert "--nproc" not in proc.stderr
    proc = _slurm(tmp_path, *SLURM_ARGS, "--nodes", "3", "--gpus-per-node", "1")
    assert "use --gpus-per-node 2 with --nodes 3 (or a multiple of it)" in proc.stderr


GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"

EXPERTS_7 = (
    "policy.model.num_experts=7 is not divisible by "
    "policy.megatron_cfg.expert_model_parallel_size=2"
)


# --------------------------------------------------------------------------- 5. Slurm


@pytest.mark.one_line
def test_slurm_dry_run_is_readable_named_after_the_recipe_and_writes_nothing(tmp_path):
    out, jobs = tmp_path / "runs", tmp_path / "jobs"
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/slurm.py",
            str(GRPO.relative_to(ROOT)),
            "policy.train_global_batch_size=64",  # 16 ranks x one group of 4 each
            "--account=A",
            "--partition=P",
            "--nodes=2",
            f"--output-dir={out}",
            f"--job-dir={jobs}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_home_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # Readable whatever the temporary folder's path (longer under pytest-xdist's workers).
    assert max(len(line.replace(str(tmp_path), "T")) for line in text.splitlines()) <= 200
    assert "#SBATCH --job-name=grpo_moe_tiny\n" in text
    assert "A-A." not in text
    assert text.startswith("# submit with:\nsbatch ")
    # The srun/torchrun command is folded with continuations and reads back as one command.
    command = text.replace(" \\\n    ", " ")
    assert re.search(
        r"srun .* torchrun .*--nnodes 2 --nproc-per-node 8 .*-m nemo_moe_metrics.train", command
    )
    assert "Entering Experiment" not in text  # nemo-run's narration is not the dry run
    assert not out.exists() and not jobs.exists()
    assert not list((tmp_path / "home").iterdir()), "nothing in the home directory either"


@pytest.mark.one_line
def test_slurm_dry_run_checks_the_layout_on_the_cluster_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "recipes/slurm.py", str(GRPO), "policy.model.num_experts=7",
         "--account=A", "--partition=P"],
        capture_output=True, text=True, cwd=ROOT, env=clean_home_env(tmp_path), timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr


RECIPE = "examples/configs/grpo_moe_tiny.yaml"

STEPS = "training.max_steps=3"  # as the session's local main job (conftest.main_job_run)

CLUSTER = ("--account", "local", "--partition", "debug", "--gpus-per-node", "0")

# The jobs below, as docs/*/slurm.md shows them (paths and ports aside).
ONE_NODE = (RECIPE, STEPS, *CLUSTER, "--nodes", "1", "--ranks-per-node", "2")


# --------------------------------------------------------------------------- no cluster needed


@pytest.mark.one_line
def test_cpu_dry_run_asks_for_cores_not_gpus_and_torchrun_starts_the_ranks(monkeypatch):
    from nemo_moe_metrics.launch import slurm_dry_run

    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    monkeypatch.chdir(ROOT)
    text = slurm_dry_run(
        RECIPE, [], "rel/runs", account="local", partition="debug", gpus_per_node=0,
        ranks_per_node=2,
    )  # fmt: skip
    text = text.replace(" \\\n    ", " ")
    assert "#SBATCH --cpus-per-task=2\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert "--gpus" not in text
    assert "export OMP_NUM_THREADS=1\n" in text
    assert f"export PATH={Path(sys.executable).parent}:$PATH\n" in text
    assert "--nnodes 1 --nproc-per-node 2 " in text
    # The run directory is resolved where the command runs (the job starts in its own copy).
    assert f"--output-dir {ROOT / 'rel' / 'runs' / 'grpo_moe_tiny'}\n" in text
    assert f"--recipe {RECIPE} " in text


@pytest.mark.one_line
def test_srun_per_task_dry_run_gives_every_rank_a_task_and_the_first_node_address(monkeypatch):
    from nemo_moe_metrics.launch import slurm_dry_run

    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115
    monkeypatch.chdir(ROOT)
    text = slurm_dry_run(
        RECIPE, [], "runs", account="local", partition="debug", gpus_per_node=0, nodes=2,
        ranks_per_node=1, launcher="srun", rdzv_port=29999,
    )  # fmt: skip
    text = text.replace(" \\\n    ", " ")
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert "export MASTER_ADDR=$head_node_ip\nexport MASTER_PORT=29999\n" in text
    assert "unset SLURM_UNBUFFEREDIO\n" in text
    assert re.search(r"srun .*--label python -m nemo_moe_metrics.train ", text)
    assert "torchrun" not in text


@pytest.mark.one_line
def test_cpu_nodes_need_ranks_per_node_and_paths_with_nemo_run_are_refused(tmp_path):
    from nemo_moe_metrics.config import ConfigError, load_recipe
    from nemo_moe_metrics.config.preflight import preflight, slurm_rank_words
    from nemo_moe_metrics.launch.slurm_submit import (
        check_paths_survive_nemo_run,
        ranks_on_each_node,
    )

    with pytest.raises(ConfigError, match="--gpus-per-node 0 runs on CPU nodes: say how many"):
        ranks_on_each_node({"gpus_per_node": 0, "ranks_per_node": None})
    assert ranks_on_each_node({"gpus_per_node": 8}) == 8
    assert ranks_on_each_node({"gpus_per_node": 0, "ranks_per_node": 2}) == 2
    with pytest.raises(ConfigError, match="contains '/nemo_run', which nemo-run rewrites"):
        check_paths_survive_nemo_run(tmp_path / "jobs", tmp_path / "nemo_run_x" / "runs")
    check_paths_survive_nemo_run(tmp_path / "jobs", tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"--nodes 1 x --ranks-per-node 3 \(3 ranks\)"):
        preflight(load_recipe(ROOT / RECIPE), 3, slurm_rank_words(1, 3, cpu=True))


@pytest.mark.one_line
def test_an_uncommitted_recipe_inside_the_repository_is_refused(tmp_path, monkeypatch):
    from nemo_moe_metrics.config import ConfigError
    from nemo_moe_metrics.launch.slurm_submit import recipe_for_job

    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    recipe = repo / "configs" / "r.yaml"
    recipe.write_text((ROOT / RECIPE).read_text())
    outside = tmp_path / "outside.yaml"
    outside.write_text("x: 1\n")
    monkeypatch.chdir(repo)
    with pytest.raises(ConfigError, match=r"configs/r.yaml is not committed as it is"):
        recipe_for_job(recipe, check_committed=True)
    assert recipe_for_job(recipe) == "configs/r.yaml"  # the dry run shows the path all the same
    assert recipe_for_job(outside, check_committed=True) == str(outside)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "configs/r.yaml"], check=True)
    subprocess.run([*git, "commit", "-qm", "r"], check=True)
    assert recipe_for_job(recipe, check_committed=True) == "configs/r.yaml"


@pytest.mark.one_line
@pytest.mark.slow
def test_sbatch_refusal_is_one_line_in_sbatch_words(slurm, tmp_path):
    proc = slurm_py(
        slurm, tmp_path, *ONE_NODE, "--partition", "nope", "--output-dir", tmp_path / "runs",
        "--job-dir", tmp_path / "jobs", "--submit",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "error: sbatch refused the job: sbatch: error: invalid partition specified: nope"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
