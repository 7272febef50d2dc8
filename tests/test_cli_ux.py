"""A new user's path through the real command (subprocesses): light install, errors caught
before launch, the first rank error on the terminal, one run per directory, a readable Slurm
dry run, the flops command and messages that point at the right thing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"
SFT = ROOT / "examples" / "configs" / "sft_moe_tiny.yaml"
DPO = ROOT / "examples" / "configs" / "dpo_moe_tiny.yaml"
HEAVY = (
    "ray",
    "nemo_run",
    "leptonai",
    "wandb",
    "matplotlib",
    "megatron",
    "tensorboard",
    "rich",
    "mlflow",
)


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "100"}


def _cli(tmp_path, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- 1. extras


def test_core_dependencies_are_the_metric_library_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~ ]", d)[0].lower() for d in project["dependencies"]}
    assert core == {"torch", "numpy", "pydantic", "pyyaml"}
    extras = project["optional-dependencies"]
    assert {"megatron", "launch", "wandb", "tensorboard", "report", "all", "test"} <= set(extras)
    assert "leptonai==0.27.3" in extras["launch"]
    assert any(d.startswith("nemo-run") for d in extras["launch"])
    assert any("[all]" in d for d in extras["test"]), "the test extra pulls everything it needs"


def test_importing_the_library_imports_no_launcher_ray_or_sink_backend():
    code = (
        "import sys, nemo_moe_metrics, nemo_moe_metrics.worker, nemo_moe_metrics.flops, "
        "nemo_moe_metrics.moe, nemo_moe_metrics.moe.collector, nemo_moe_metrics.worker.policy_metrics, nemo_moe_metrics.moe.aux_loss, "
        "nemo_moe_metrics.moe.reduction, nemo_moe_metrics.sinks, nemo_moe_metrics.cli, "
        "nemo_moe_metrics.config.preflight\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# Run the CLI with some modules made uninstallable (as in a core-only install).
_BLOCKED_CLI = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from nemo_moe_metrics.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli_without(tmp_path, blocked, *args):
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_CLI.format(blocked=set(blocked)), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tmp_path),
        timeout=120,
    )


def test_run_without_the_launch_extra_names_it_before_launching(tmp_path):
    proc = _cli_without(tmp_path, {"nemo_run"}, "run", GRPO, "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2, proc.stderr
    assert "needs the 'launch' extra (nemo_run is not installed)" in proc.stderr
    assert "pip install 'nemo_moe_metrics[launch]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_report_without_matplotlib_prints_the_summary_and_names_the_report_extra(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    proc = _cli_without(tmp_path, {"matplotlib"}, "report", run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'nemo_moe_metrics[report]'" in proc.stdout
    assert "pictures skipped: drawing the report's pictures needs the 'report' extra" in proc.stdout
    assert "throughput: not logged" in proc.stdout  # the text summary is there
    assert not list(run_dir.glob("*.png"))


# --------------------------------------------------------------------------- 2. preflight

EXPERTS_7 = "policy.model.num_experts=7 is not divisible by policy.megatron_cfg.expert_model_parallel_size=2"


def test_check_rejects_experts_not_divisible_by_expert_parallel(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "policy.model.num_experts=7")
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr
    assert "set num_experts to a multiple of 2 (e.g. 8)" in proc.stderr


def test_run_rejects_experts_not_divisible_before_any_launch(tmp_path):
    out = tmp_path / "runs"
    proc = _cli(tmp_path, "run", GRPO, "policy.model.num_experts=7", "--output-dir", out)
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr
    assert not out.exists(), "nothing was launched or written"


def test_check_rejects_a_world_size_that_does_not_fit_expert_parallel(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "--nproc", "3")
    assert proc.returncode == 2
    assert "--nproc 3 does not fit policy.megatron_cfg.expert_model_parallel_size=2" in proc.stderr
    assert "use --nproc 2" in proc.stderr


def test_check_rejects_pipeline_parallel_for_the_reference_worker(tmp_path):
    proc = _cli(tmp_path, "check", SFT, "policy.megatron_cfg.pipeline_model_parallel_size=2")
    assert proc.returncode == 2
    assert "pipeline_model_parallel_size=2" in proc.stderr
    assert "set both to 1" in proc.stderr


def test_check_rejects_grpo_batch_without_whole_groups(tmp_path):
    proc = _cli(
        tmp_path,
        "check",
        GRPO,
        "policy.train_global_batch_size=6",
        "policy.train_micro_batch_size=2",
    )
    assert proc.returncode == 2
    text = " ".join(proc.stderr.split())
    # 6 over the 2 data-parallel ranks of the default --nproc 2: 3 each, no whole microbatch
    # of 2 nor group of 4; the smallest global batch that fits both is 2 x lcm(2, 4) = 8.
    assert "policy.train_global_batch_size=6 is not a multiple of data-parallel size 2 x" in text
    assert "a multiple of 8 (e.g. 8)" in text


def test_check_rejects_grpo_prompt_and_response_longer_than_seq_length(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "grpo.response_length=30")
    assert proc.returncode == 2
    assert (
        "grpo.prompt_length=8 + grpo.response_length=30 exceeds policy.model.seq_length=32"
        in proc.stderr
    )
    assert "raise seq_length to 38" in proc.stderr


def test_check_rejects_odd_dpo_batches(tmp_path):
    proc = _cli(
        tmp_path,
        "check",
        DPO,
        "policy.train_global_batch_size=3",
        "policy.train_micro_batch_size=1",
    )
    assert proc.returncode == 2
    assert "must both be even for DPO" in proc.stderr


def test_check_rejects_sft_min_length_above_seq_length(tmp_path):
    proc = _cli(tmp_path, "check", SFT, "training.min_seq_length=40")
    assert proc.returncode == 2
    assert "training.min_seq_length=40 must lie in [2, policy.model.seq_length=32]" in proc.stderr


def test_check_lists_every_problem_at_once(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "policy.model.num_experts=7", "grpo.response_length=30")
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr and "exceeds policy.model.seq_length=32" in proc.stderr


def test_check_accepts_the_shipped_recipes_on_their_ranks(tmp_path):
    for recipe in (SFT, DPO, GRPO):
        proc = _cli(tmp_path, "check", recipe)
        assert proc.returncode == 0, proc.stderr


def test_top_k_above_experts_names_the_override(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "policy.model.moe_router_topk=9")
    assert proc.returncode == 2
    assert "override 'policy.model.moe_router_topk=9': moe_router_topk=9 exceeds num_experts=8" in (
        proc.stderr
    )


# --------------------------------------------------------------------------- 3. first error


def test_first_rank_failure_reads_the_last_of_chained_exceptions(tmp_path):
    from nemo_moe_metrics.launch import first_rank_failure

    log = tmp_path / "combined.log"
    log.write_text(
        "[default1]:some warning\n"
        "[default1]:[rank1]: Traceback (most recent call last):\n"
        '[default1]:[rank1]:   File "/x/nemo_moe_metrics/train.py", line 5, in main\n'
        "[default1]:[rank1]:     run()\n"
        '[default1]:[rank1]:   File "/v/lib/python3.11/site-packages/foo/bar.py", line 9, in run\n'
        "[default1]:[rank1]:     raise KeyError('a')\n"
        "[default1]:[rank1]: KeyError: 'a'\n"
        "[default1]:[rank1]: \n"
        "[default1]:[rank1]: The above exception was the direct cause of the following exception:\n"
        "[default1]:[rank1]: \n"
        "[default1]:[rank1]: Traceback (most recent call last):\n"
        '[default1]:[rank1]:   File "/x/nemo_moe_metrics/worker.py", line 7, in step\n'
        "[default1]:[rank1]:     boom()\n"
        "[default1]:[rank1]: ValueError: bad layout\n"
        "[default1]:[rank1]:   second line of the message\n"
        "[default0]:Traceback (most recent call last):\n"
        "[default0]:ValueError: later rank\n"
    )
    failure = first_rank_failure(log)
    assert failure.rank == 1
    assert failure.exception == "ValueError: bad layout\n  second line of the message"
    assert failure.frame == "/x/nemo_moe_metrics/worker.py:7 in step"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_failed_rank_prints_its_first_exception_log_path_and_a_working_status_hint(tmp_path):
    # kv_channels=15: RoPE needs an even head dim; megatron-core fails inside the first forward
    # on every rank, well after the process group and the model are up.
    out = tmp_path / "runs"
    proc = _cli(
        tmp_path,
        "run",
        GRPO,
        "training.max_steps=1",
        "policy.model.kv_channels=15",
        "--output-dir",
        out,
        timeout=380,
    )
    assert proc.returncode == 1
    text = proc.stdout
    assert re.search(
        r"rank \d raised RuntimeError: The size of tensor a \(15\) must match the size of "
        r"tensor b \(16\)",
        text,
    ), text
    assert "nemo_moe_metrics/algorithms/megatron_policy.py:" in text  # the frame in this library
    assert "raised in megatron/core/models/common/embeddings/rope_utils.py:" in text
    lines = text.splitlines()
    rank_log = next(line for line in lines if line.startswith("rank log: "))
    assert Path(rank_log.removeprefix("rank log: ")).is_file()
    # The exception comes before the log path, and no nemo-run boilerplate is shown.
    assert lines.index(rank_log) > next(i for i, x in enumerate(lines) if "raised Runtime" in x)
    assert "nemo experiment logs" not in text
    hint = next(line for line in lines if line.startswith("job status: "))
    assert "NEMORUN_HOME=" in hint
    status = subprocess.run(
        hint.removeprefix("job status: "),
        shell=True,
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "FAILED" in status.stdout


# --------------------------------------------------------------------------- 4. one run per dir


def test_rerun_into_an_existing_run_directory_is_refused(tmp_path):
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    proc = _cli(tmp_path, "run", GRPO, "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert f"run directory {run_dir} already holds a run (metrics.jsonl)" in proc.stderr
    assert "pass --resume to continue it, --overwrite to delete it" in proc.stderr
    # Nothing launched; the run directory's lock (taken before deciding) is all that was added.
    assert sorted(p.name for p in run_dir.iterdir()) == [".run.lock", "metrics.jsonl"]


def test_resume_into_an_empty_directory_is_refused(tmp_path):
    proc = _cli(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert "holds no run to continue; drop --resume" in proc.stderr


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    proc = _cli(tmp_path, "run", GRPO, "--resume", "--overwrite")
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_overwrite_clears_the_old_run(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "grpo_moe_tiny"
    # An old run's leftovers: 8 steps of JSONL, an event file, an offline W&B run, a picture.
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"old")
    (run_dir / "wandb" / "offline-run-old").mkdir(parents=True)
    (run_dir / "expert_load_heatmap.png").write_bytes(b"old")
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(8)))
    proc = _cli(
        tmp_path, "run", GRPO, "training.max_steps=1", "--overwrite", "--output-dir", runs,
        timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]
    assert [p.name for p in (run_dir / "tensorboard").iterdir()] != []
    assert not (run_dir / "tensorboard" / "events.out.tfevents.1.old").exists()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [p.name for p in (run_dir / "wandb").glob("offline-run-*")] != ["offline-run-old"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert (run_dir / "expert_load_heatmap.png").stat().st_size > 10_000
    # test_run_faults.py continues a run with --resume after each of its faults.


# --------------------------------------------------------------------------- 5. Slurm


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
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert max(len(line) for line in text.splitlines()) <= 200
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


def test_slurm_dry_run_checks_the_layout_on_the_cluster_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "recipes/slurm.py", str(GRPO), "policy.model.num_experts=7",
         "--account=A", "--partition=P"],
        capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 2
    assert EXPERTS_7 in proc.stderr


# --------------------------------------------------------------------------- 6. flops


def test_flops_accepts_a_model_directory_holding_config_json(tmp_path):
    model_dir = tmp_path / "Qwen3-30B-A3B"
    model_dir.mkdir()
    fixture = ROOT / "nemo_moe_metrics" / "flops" / "fixtures" / "qwen3-30b-a3b.json"
    (model_dir / "config.json").write_text(fixture.read_text())
    by_dir = _cli(tmp_path, "flops", "--config", model_dir, "--seq-lens", "128", "--json")
    by_name = _cli(tmp_path, "flops", "--config", "qwen3-30b-a3b", "--seq-lens", "128", "--json")
    assert by_dir.returncode == 0, by_dir.stderr
    assert json.loads(by_dir.stdout)["total"] == json.loads(by_name.stdout)["total"] > 0


def test_flops_directory_without_config_json_says_so(tmp_path):
    proc = _cli(tmp_path, "flops", "--config", tmp_path, "--seq-lens", "8")
    assert proc.returncode == 2
    assert "the directory has no config.json" in proc.stderr


def test_flops_missing_path_says_it_does_not_exist(tmp_path):
    proc = _cli(tmp_path, "flops", "--config", tmp_path / "nope" / "config.json", "--seq-lens", "8")
    assert proc.returncode == 2
    assert "no such file or directory" in proc.stderr
    assert "neither a config.json file nor a shipped model" not in proc.stderr


def test_flops_list_prints_the_shipped_models(tmp_path):
    proc = _cli(tmp_path, "flops", "--list")
    assert proc.returncode == 0, proc.stderr
    shipped = sorted(p.stem for p in (ROOT / "nemo_moe_metrics/flops/fixtures").glob("*.json"))
    listed = [line.split()[0] for line in proc.stdout.splitlines()[1:]]
    assert listed == shipped


def test_flops_zero_tokens_is_an_error_that_says_so(tmp_path):
    proc = _cli(tmp_path, "flops", "--config", "qwen3-30b-a3b", "--seq-lens", "0")
    assert proc.returncode == 2
    assert "zero tokens in total, so there is nothing to count" in proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------- 8. messages


def test_override_error_names_the_override_not_the_file(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "policy.megatron_cfg.track_moe_metric=true")
    assert proc.returncode == 2
    assert "override 'policy.megatron_cfg.track_moe_metric=true': unknown key" in proc.stderr
    assert f"invalid recipe {GRPO}" not in proc.stderr


def test_a_broken_recipe_file_is_still_reported_against_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GRPO.read_text().replace("num_generations: 4", "num_generation: 4"))
    proc = _cli(tmp_path, "check", recipe, "training.max_steps=2")
    assert proc.returncode == 2
    assert f"invalid recipe {recipe}:" in proc.stderr
    assert "override 'training.max_steps=2'" not in proc.stderr


def test_subcommand_typo_shows_the_subcommands_usage(tmp_path):
    proc = _cli(tmp_path, "run", GRPO, "--nprocs", "2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: nemo-moe-metrics run ")
    assert "unrecognized arguments: --nprocs 2 (did you mean --nproc?)" in proc.stderr


def test_no_docstring_or_comment_points_outside_the_repository():
    outside = re.compile(r"shared/|/work/|ENVIRONMENT\.md|~/\.")
    hits = [
        str(p.relative_to(ROOT))
        for folder in ("nemo_moe_metrics", "recipes", "benchmarks", "examples")
        for p in (ROOT / folder).rglob("*.py")
        if outside.search(p.read_text())
    ]
    assert not hits
