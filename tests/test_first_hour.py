"""Issue 25, a new user's first hour (second pass): each trip-up, through the real command or the
public API. Kept fast: no training processes are launched here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_ux import _cli, _env  # the real CLI in a clean HOME, as test_cli_ux runs it

from nemo_moe_metrics.config import preflight as _preflight

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"
SFT = ROOT / "examples" / "configs" / "sft_moe_tiny.yaml"
MCFG = _preflight.MCFG  # the recipe's metric-flag block, "policy.<worker>_cfg"


def _python(tmp_path, code, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- 14. exports


def test_top_level_exports_the_public_api_lazily(tmp_path):
    code = (
        "import sys\n"
        "import nemo_moe_metrics\n"
        "bare = {m.split('.')[0] for m in sys.modules}\n"
        "from nemo_moe_metrics import PolicyMetrics, MetricsConfig, LoggerConfig, build_sinks\n"
        "from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics as P\n"
        "assert PolicyMetrics is P, 'the same class, not a copy'\n"
        "for name in nemo_moe_metrics.__all__:\n"
        "    getattr(nemo_moe_metrics, name)\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'matplotlib', 'wandb', 'nemo_run'}\n"
        "print(sorted(bare & {'torch', 'pydantic', 'numpy'}), sorted(heavy))\n"
        "print(MetricsConfig(track_moe_metrics=True).track_moe_metrics)\n"
    )
    proc = _python(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[] []", "True"]


def test_an_unknown_top_level_name_is_an_attribute_error(tmp_path):
    import nemo_moe_metrics

    with pytest.raises(AttributeError, match="has no attribute 'PolicyMetric'"):
        nemo_moe_metrics.PolicyMetric  # noqa: B018


# --------------------------------------------------------------------------- 1. examples' extra


def _extra_requirements(extra: str) -> set[str]:
    """Distribution names ``pip install '.[extra]'`` asks for, nested extras expanded."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: set[str] = set()
    for req in project["optional-dependencies"][extra]:
        name = re.split(r"[<>=!~ \[]", req)[0].lower().replace("_", "-")
        if name == "nemo-moe-metrics":
            for sub in req.split("[", 1)[1].rstrip("]").split(","):
                out |= _extra_requirements(sub.strip())
        else:
            out.add(name)
    return out


@pytest.mark.parametrize(
    "example", sorted(p.name for p in (ROOT / "examples").glob("integrate_*.py"))
)
def test_the_all_extra_installs_every_import_of_both_examples(example):
    import ast
    import importlib.metadata as md

    tree = ast.parse((ROOT / "examples" / example).read_text())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0] for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }  # fmt: skip
    third_party = roots - set(sys.stdlib_module_names) - {"nemo_moe_metrics", "__future__"}
    third_party -= {p.stem for p in (ROOT / "examples").glob("*.py")}  # a sibling example
    provided = _extra_requirements("all") | {"torch", "numpy", "pydantic", "pyyaml"}
    if example == "integrate_torchtitan.py":  # its own install line: its pins clash with [all]
        from nemo_moe_metrics.runtime.extras import TORCHTITAN_INSTALL

        provided |= {
            w.split("==")[0].lower().replace("_", "-")
            for w in TORCHTITAN_INSTALL.split()
            if "==" in w
        }
    dists = md.packages_distributions()
    for module in third_party:
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert names & provided, f"{example} imports {module}, which [all] does not install"
    assert "transformers" in _extra_requirements("all")


def test_the_hf_example_without_transformers_names_the_hf_extra(tmp_path):
    code = (
        "import sys, importlib.abc, runpy\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['integrate_hf_fsdp.py', '--out', sys.argv[1]]\n"
        "runpy.run_path('examples/integrate_hf_fsdp.py', run_name='__main__')\n"
    )
    proc = _python(tmp_path, code, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: examples/integrate_hf_fsdp.py needs the 'hf' extra (transformers is not "
        "installed); install it with: pip install 'nemo_moe_metrics[hf]'"
    )


# --------------------------------------------------------------------------- 2. build_sinks


def _log_steps(sink, steps):
    for step in steps:
        sink.log({"train/loss": float(step)}, step)
    sink.close()


def test_build_sinks_refuses_a_directory_that_holds_a_run(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks
    from nemo_moe_metrics.sinks import RunExistsError

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="first"), range(3))
    before = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()
    with pytest.raises(RunExistsError) as err:
        build_sinks(cfg, tmp_path, run_name="second")
    assert f"{tmp_path} already holds a run (metrics.jsonl)" in str(err.value)
    assert "Pass LoggerConfig(resume=True) to continue it" in str(err.value)
    assert "build_sinks(..., overwrite=True)" in str(err.value)
    after = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()
    assert after == before, "nothing was touched"


def test_build_sinks_overwrite_replaces_the_run_and_keeps_the_users_files(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="first"), range(3))
    first_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    (tmp_path / "checkpoint.pt").write_bytes(b"user data")
    (tmp_path / "expert_load_heatmap.png").write_bytes(b"old picture")
    _log_steps(build_sinks(cfg, tmp_path, run_name="second", overwrite=True), [0])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["run_name"] == "second" and meta["run_id"] != first_id
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"user data"
    assert not (tmp_path / "expert_load_heatmap.png").exists()


def test_build_sinks_resume_continues_the_run(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    _log_steps(build_sinks(cfg, tmp_path, run_name="r"), range(2))
    _log_steps(build_sinks(cfg.model_copy(update={"resume": True}), tmp_path, run_name="r"), [2])
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


# --------------------------------------------------------------------------- 12. failed early


def test_a_run_that_failed_before_logging_does_not_block_build_sinks(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=True, wandb_enabled=False)
    build_sinks(cfg, tmp_path, run_name="crashed").close()  # opened, then died: nothing logged
    assert (tmp_path / "metrics.jsonl").stat().st_size == 0
    _log_steps(build_sinks(cfg, tmp_path, run_name="rerun"), range(2))
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


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
    proc = _cli(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2
    assert f"--resume: {run_dir} holds a run that logged no step; drop --resume" in proc.stderr


# --------------------------------------------------------------------------- 4. resume finished


def test_resume_of_a_finished_run_says_it_is_at_max_steps_and_how_to_extend(tmp_path):
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "train/loss": 0.0} for s in range(8)]  # the recipe's max_steps is 8
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in run_dir.iterdir())
    proc = _cli(tmp_path, "run", GRPO, "--resume", "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"--resume: {run_dir} is already at training.max_steps=8 (last logged step 7)"
        in proc.stderr
    )
    assert f"nemo-moe-metrics run {GRPO} training.max_steps=16 --resume" in proc.stderr
    assert "starting ranks" not in proc.stdout
    after = sorted(p.name for p in run_dir.iterdir() if p.name != ".run.lock")  # the lock stays
    assert after == before, "nothing launched or redrawn"


# --------------------------------------------------------------------------- 13. pins


def test_the_launch_extra_caps_httpx2_below_what_leptonais_anyio_cap_allows():
    # leptonai 0.27.3 caps anyio<=4.9.0; httpx2 2.7+ needs anyio>=4.10 (pip backtracked through
    # every httpx2 release to find that out). The pin must hold what is installed.
    import importlib.metadata as md
    import re
    import tomllib

    from packaging.requirements import Requirement

    launch = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["launch"]
    pin = next(Requirement(r) for r in launch if r.startswith("httpx2"))
    assert "2.7.0" not in pin.specifier and "2.6.0" in pin.specifier
    assert md.version("httpx2") in pin.specifier
    anyio_cap = next(
        Requirement(r) for r in md.requires("leptonai") if re.match(r"anyio\b", r)
    ).specifier
    assert "4.10.0" not in anyio_cap and "4.9.0" in anyio_cap


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
    by_file = _cli(tmp_path, "report", run_dir / "metrics.jsonl")
    by_dir = _cli(tmp_path, "report", run_dir)
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_dir.stdout
    assert by_file.stdout.startswith("run a: steps 0–1 (2 logged)")


def test_report_on_a_folder_of_runs_lists_them(tmp_path):
    runs = tmp_path / "runs"
    for name in ("sft_moe_tiny", "grpo_moe_tiny"):
        _tiny_run(runs / name)
    proc = _cli(tmp_path, "report", runs)
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
    proc = _cli(tmp_path, "report", missing)
    assert proc.returncode == 2
    assert (
        f"error: {missing} does not exist (no such directory); runs in {tmp_path / 'runs'}: "
        in (proc.stderr)
    )
    assert str(tmp_path / "runs" / "grpo_moe_tiny") in proc.stderr


def test_report_with_an_out_that_is_a_file_is_a_clear_error(tmp_path):
    run_dir = _tiny_run(tmp_path / "run")
    (tmp_path / "pictures").write_text("a file")
    proc = _cli(tmp_path, "report", run_dir, "--out", tmp_path / "pictures")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: cannot write the pictures into {tmp_path / 'pictures'}: it is a file, "
        "not a directory"
    )
    proc = _cli(tmp_path, "report", run_dir, "--out", tmp_path / "pictures" / "sub")
    assert proc.returncode == 2
    assert f"error: cannot write the pictures into {tmp_path / 'pictures' / 'sub'}: " in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- 8. check summary


def test_check_ends_with_the_layout_and_ok(tmp_path):
    proc = _cli(tmp_path, "check", GRPO, "--nproc", "4", "policy.train_micro_batch_size=4")
    assert proc.returncode == 0, proc.stderr
    # 4 ranks, no pipeline/context split: data-parallel 4; 8 experts over expert-parallel 2;
    # the global batch of 16 is 4 sequences per rank, one microbatch of 4; 4 prompts x 4.
    assert proc.stdout.splitlines()[-7:] == [
        "layout on 4 rank(s):",
        "  data-parallel size: 4 (tensor 1 x pipeline 1 x context 1 x data 4)",
        "  experts per rank: 4 of 8 (expert-parallel 2, top-2)",
        "  sequences per step: 16 over all 4 data-parallel rank(s) (policy.train_global_batch_size,"
        " as in NeMo RL and Megatron), 4 per rank",
        "  microbatches per rank: 1 per step, 4 sequences each",
        "  rollouts per step: 4 prompts x 4 generations (NeMo RL's grpo.num_prompts_per_step x "
        "num_generations_per_prompt)",
        "OK: recipe 'grpo_moe_tiny' can run on 4 rank(s) (8 steps of grpo)",
    ]


@pytest.mark.parametrize(
    "nproc,overrides,needle",
    [
        # 16 over 2 ranks is 8 each: not a whole microbatch of 16.
        ("2", ["policy.train_micro_batch_size=16"], "multiple of data-parallel size 2 x "
         "policy.train_micro_batch_size=16: it counts the step's sequences over all 2 "
         "data-parallel ranks of --nproc 2 (as in NeMo RL and Megatron): each rank trains 16/2"),
        # 16 over 8 ranks is 2 each: not a whole group of 4 generations.
        ("8", ["policy.train_micro_batch_size=1"], "multiple of data-parallel size 8 x "
         "grpo.num_generations=4: each data-parallel rank samples whole groups of 4"),
    ],
)  # fmt: skip
def test_check_refuses_a_global_batch_the_data_parallel_ranks_cannot_split(
    tmp_path, nproc, overrides, needle
):
    proc = _cli(tmp_path, "check", GRPO, "--nproc", nproc, *overrides)
    assert proc.returncode == 2
    text = " ".join(proc.stderr.split())
    assert needle in text, text
    assert "set train_global_batch_size to a multiple of" in text


def test_check_of_a_dense_recipe_says_it_has_no_experts(tmp_path):
    proc = _cli(
        tmp_path,
        "check",
        SFT,
        "policy.model.num_experts=null",
        f"{MCFG}.expert_model_parallel_size=1",
        "--nproc",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "  experts per rank: none (a dense model)\n" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "OK: recipe 'sft_moe_tiny' can run on 1 rank(s) (8 steps of sft)"
    )


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
    env = _env(tmp_path)
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


# --------------------------------------------------------------------------- 5. caller's terms


def _api_run(run_dir: Path, rows: dict[int, dict], config=None) -> Path:
    from nemo_moe_metrics import LoggerConfig, build_sinks

    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, run_dir, run_name="api", config=config)
    for step, metrics in rows.items():
        sink.log(metrics, step)
    sink.close()
    return run_dir


def _table(counts):
    return [[0, e, c, 100.0 * c / sum(counts)] for e, c in enumerate(counts)]


def test_report_hints_speak_metricsconfig_to_api_users(tmp_path):
    from nemo_moe_metrics import render_report

    perf = {"train_perf/tokens_per_second": 50.0, "train_perf/tflops_per_gpu": 0.001}
    rows = {0: {**perf, "moe/expert_loads": _table([3, 1, 2, 2])}, 1: dict(perf)}
    summary = render_report(_api_run(tmp_path / "api", rows))
    assert (
        "MFU not logged (unknown accelerator peak; pass MetricsConfig(peak_flops_per_gpu=...))"
        in (summary)
    )
    assert "aux losses: not logged; enable MetricsConfig(track_moe_metrics=True)" in summary
    assert MCFG not in summary and "logger." not in summary
    # The whole run holds one table step: no --steps to widen; log the table more often.
    assert (
        "only 1 logged step with expert counts in the whole run: expert_load_over_steps.png and "
        "routing_drift.png skipped; they need 2 or more: log the table more often with "
        "LoggerConfig(table_every=...), or train more steps"
    ) in summary
    assert "--steps" not in summary
    # The same run written by a recipe (run.json holds the Recipe dump) gets recipe keys.
    recipe = _api_run(tmp_path / "recipe", rows, config={"algorithm": "grpo"})
    summary = render_report(recipe)
    assert f"set {MCFG}.peak_flops_per_gpu" in summary
    assert "log the table more often with logger.table_every, or train more steps" in summary


def test_microbatch_outside_step_names_the_public_calls():
    import torch
    from hf_tiny import tiny_config

    from nemo_moe_metrics import MetricsConfig, PolicyMetrics

    metrics = PolicyMetrics(MetricsConfig(track_throughput=True))
    metrics.attach(torch.nn.Linear(2, 2), tiny_config("qwen3_moe"))
    with pytest.raises(RuntimeError) as err:
        metrics.microbatch(torch.tensor([5, 7]))
    assert str(err.value) == (
        "PolicyMetrics.microbatch() called outside a step; call it once per training "
        "microbatch inside `with metrics.step():` (before the microbatch's forward), then "
        "finish_step() after the block"
    )
    assert "add_sequences" not in str(err.value) and "meter" not in str(err.value)
    nested = pytest.raises(RuntimeError, match=r"PolicyMetrics.step\(\) is already open")
    with metrics.step(), nested, metrics.step():
        pass
    with metrics.step():  # the failed nesting left no open step behind
        metrics.microbatch(torch.tensor([5, 7]))
    assert metrics.finish_step(1)["train_perf/tokens"] == 12


def test_unknown_router_warning_on_a_one_process_hf_model_does_not_mention_pipelines():
    import torch
    from hf_tiny import tiny_config

    from nemo_moe_metrics import MetricsConfig, PolicyMetrics

    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    with pytest.warns(RuntimeWarning) as caught:
        metrics.attach(torch.nn.Linear(2, 2), tiny_config("qwen3_moe"))
    text = str(caught[0].message)
    assert "the config (qwen3_moe) says 8 experts but the model has no module that follows" in text
    assert "experts(hidden_states, top_k_index, top_k_weights)" in text
    assert "docs/en/models.md" in text
    assert "nemo_moe_metrics.register_router(RouterClass, counts_fn)" in text
    assert "pipeline" not in text


# --------------------------------------------------------------------------- 11. GRPO progress


def test_grpo_progress_text_puts_reward_first_and_labels_the_loss():
    from nemo_moe_metrics.launch import GRPO_LOSS_NOTE, describe_step

    row = {"step": 3, "train/loss": 0.0, "train/reward": 0.3125, "moe/max_over_ideal": 1.5}
    assert describe_step(row, "grpo") == "reward 0.312  pg-loss 0.0000  max/ideal 1.50"
    assert describe_step(row, "sft") == "loss 0.0000  reward 0.312  max/ideal 1.50"
    assert "about 0 on-policy" in GRPO_LOSS_NOTE and "gradient is not 0" in GRPO_LOSS_NOTE


# --------------------------------------------------------------------------- 7. pictures


def _timeline(steps, n_experts=4):
    import numpy as np

    from nemo_moe_metrics.report.timeline import Timeline

    timeline = Timeline(keep_sum=False, dead_steps=10)
    rng = np.random.default_rng(0)
    for step in steps:
        timeline.add(step, [1, 3], rng.integers(1, 50, size=(2, n_experts)))
    return timeline


@pytest.mark.parametrize("steps", [[0, 1, 2, 3], [5, 10, 15, 20, 25]])
def test_over_steps_columns_are_centred_on_their_steps_with_no_extra_tick(steps):
    import numpy as np

    from nemo_moe_metrics.report.pictures import bin_ratios, over_steps_figure
    from nemo_moe_metrics.report.reading import RunInfo

    timeline = _timeline(steps)
    _, shown = bin_ratios(timeline.bins, [0, 1])
    fig = over_steps_figure(RunInfo("t"), timeline, [0, 1], shown, 2.0, "chosen")
    ax = fig.axes[1]  # the bottom panel carries the step axis
    x_edges = ax.collections[0].get_coordinates()[0, :, 0]
    centres = (x_edges[:-1] + x_edges[1:]) / 2
    assert centres.tolist() == pytest.approx(steps)  # each column sits on its logged step
    ticks = ax.get_xticks()
    assert set(ticks) <= set(range(steps[0], steps[-1] + 1)), ticks  # no step that did not run
    assert ticks.min() >= steps[0] and ticks.max() <= steps[-1]
    half = (steps[1] - steps[0]) / 2
    assert ax.get_xlim() == pytest.approx((steps[0] - half, steps[-1] + half))
    assert np.all(np.diff(x_edges) > 0)


@pytest.mark.parametrize("n_layers", [3, 24])
def test_layer_series_legend_never_covers_the_plot_and_no_line_is_faint(n_layers):
    import numpy as np

    from nemo_moe_metrics.report.pictures import layer_series_figure
    from nemo_moe_metrics.report.reading import RunInfo

    steps = list(range(12))
    rng = np.random.default_rng(1)
    series = {la: 1.0 + rng.random(len(steps)) for la in range(n_layers)}
    # The last points high on the right, where an "upper right" legend used to sit.
    for vs in series.values():
        vs[-1] = 2.5
    fig = layer_series_figure(RunInfo("t"), steps, series, ylabel="max/ideal", title="t", ideal=1.0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    (legend,) = fig.legends
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert set(ax.get_xticks()) <= set(steps)

    def contrast_with_white(rgb):
        c = np.where(rgb <= 0.03928, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        lum = 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
        return 1.05 / (lum + 0.05)

    from matplotlib.colors import to_rgb

    rgbs = [np.asarray(to_rgb(line.get_color())) for line in ax.get_lines()]
    worst = min(contrast_with_white(c) for c in rgbs)
    assert worst >= 2.5, worst  # viridis' yellow end is 1.26:1 against white


# --------------------------------------------------------------------------- 9. docs agree


def test_suite_time_agrees_between_readme_and_versions():
    import re

    readme = (ROOT / "README.md").read_text()
    versions = (ROOT / "docs" / "en" / "versions.md").read_text()
    # "about 9 minutes" or "about 9 to 10 minutes"; the same figure on all three pages.
    pattern = r"test suite takes about (\d+(?: to \d+)?) minutes on 2 cores"
    in_readme = re.search(pattern, readme)
    in_versions = re.search(pattern, re.sub(r"\s+", " ", versions))
    assert in_readme and in_versions, "README and versions.md must both state the suite's time"
    assert in_readme[1] == in_versions[1]
    zh = (ROOT / "docs" / "zh" / "versions.md").read_text()
    assert f"约需 {in_readme[1].replace(' to ', ' 到 ')} 分钟" in zh


def test_top_level_help_mentions_hugging_face_models(tmp_path):
    proc = _cli(tmp_path, "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "for Megatron-core and Hugging Face models" in text


def test_troubleshooting_says_attach_takes_a_config_json_dict():
    from hf_tiny import tiny_config

    from nemo_moe_metrics.worker.policy_metrics import model_facts

    en = " ".join((ROOT / "docs" / "en" / "troubleshooting.md").read_text().split())
    assert "not a dict" not in en
    assert "its `config.json` as a dict holding `model_type`" in en
    zh = (ROOT / "docs" / "zh" / "troubleshooting.md").read_text()
    assert "而不是字典" not in zh
    # What the docs say is what attach does: a config.json dict is accepted.
    as_dict = {**tiny_config("qwen3_moe").to_dict(), "model_type": "qwen3_moe"}
    assert model_facts(as_dict).num_experts == 8


def test_train_global_batch_size_counts_all_data_parallel_ranks_as_in_nemo_rl():
    from nemo_moe_metrics.config import ConfigError, PolicyConfig, load_recipe

    text = PolicyConfig.model_fields["train_global_batch_size"].description
    assert "ALL data-parallel ranks" in text and "NeMo RL" in text and "used to" in text
    for recipe in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        body = recipe.read_text()
        assert "counts the step's sequences over ALL data-parallel ranks" in body, recipe.name
        assert "multiply an older" in body, recipe.name  # the note for the old meaning
    for lang, needle in (("en", "Changed: it used to count"), ("zh", "变更")):
        loops = " ".join((ROOT / "docs" / lang / "training_loops.md").read_text().split())
        assert needle in loops and "num_prompts_per_step" in loops, lang
    # A NeMo RL grpo section copied as is is refused with what each key is here.
    with pytest.raises(ConfigError, match="num_generations_per_prompt is grpo.num_generations"):
        load_recipe(GRPO, ["grpo.num_generations_per_prompt=4"])
    with pytest.raises(ConfigError, match="num_prompts_per_step x grpo.num_generations"):
        load_recipe(GRPO, ["grpo.num_prompts_per_step=4"])


# --------------------------------------------------------------------------- 10. README lines


def _readme_commands() -> list[str]:
    import re

    text = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, re.S) if "-m venv" in c]


def test_readme_312_line_finds_python312_from_pyenv_verbatim(tmp_path):
    import shutil

    line = next(c for c in _readme_commands() if ".venv312" in c)
    interpreter = line.split(" -m venv ")[0]  # the part that has to find Python 3.12
    if not shutil.which("pyenv") and not shutil.which("python3.12"):
        pytest.skip("neither pyenv nor python3.12 on this machine")
    proc = subprocess.run(
        f"{interpreter} -c 'import sys; print(sys.version_info[:2])'",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYENV_VERSION"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(3, 12)"


def test_readme_lines_use_their_own_venv_and_run_directory():
    import re

    from nemo_moe_metrics.config import load_recipe

    lines = [c for c in _readme_commands() if "nemo-moe-metrics run" in c]
    assert len(lines) == 2
    venvs = {re.search(r"-m venv (\S+)", c)[1] for c in lines}
    runs = {load_recipe(ROOT / re.search(r"run (\S+\.yaml)", c)[1]).name for c in lines}
    assert venvs == {".venv", ".venv312"}
    assert runs == {"grpo_moe_tiny", "grpo_hybrid_moe_tiny"}


def test_the_per_rank_entrypoint_refuses_a_logged_run_in_recipe_terms(tmp_path):
    # torchrun -m nemo_moe_metrics.train (e.g. a Slurm rerun) checks before touching recipe.yaml.
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import refuse_a_logged_run
    from nemo_moe_metrics.sinks import RunExistsError

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunExistsError, match="pass the override logger.resume=true to continue"):
        refuse_a_logged_run(tmp_path, load_recipe(GRPO))
    refuse_a_logged_run(tmp_path, load_recipe(GRPO, ["logger.resume=true"]))  # continues
    (tmp_path / "metrics.jsonl").write_text("")  # failed before logging: not a run
    refuse_a_logged_run(tmp_path, load_recipe(GRPO))


# --------------------------------------------------------------------------- documented run commands


def _documented_runs() -> list[tuple[str, list[str]]]:
    import re
    import shlex

    sources = [*sorted((ROOT / "examples" / "configs").glob("*.yaml"))]
    sources += [ROOT / "docs" / lang / "routing_consistency.md" for lang in ("en", "zh")]
    runs = []
    for path in sources:
        for line in path.read_text(encoding="utf-8").splitlines():
            found = re.search(r"nemo-moe-metrics run (\S+\.yaml.*)$", line.lstrip("# "))
            if found:
                args = shlex.split(found.group(1))
                runs.append((f"{path.name}: {line.strip()}", args))
    return runs


def test_documented_run_commands_in_sequence_use_distinct_run_directories():
    """A recipe's documented second command (e.g. R3 without replay) is not refused because the
    first one's run already holds the directory."""
    from nemo_moe_metrics.launch import run_dir_for

    runs = _documented_runs()
    assert any("moe_enable_routing_replay=false" in where for where, _ in runs)
    by_source: dict[str, dict] = {}
    for where, args in runs:
        recipe, overrides = args[0], [a for a in args[1:] if "=" in a and not a.startswith("-")]
        run_dir = run_dir_for(ROOT / recipe, overrides, "runs")
        seen = by_source.setdefault(where.split(":")[0], {})
        assert seen.setdefault(run_dir, where) == where, f"{where} reuses {seen[run_dir]}'s run dir"


# --------------------------------------------------------------------------- examples' start


def test_an_example_started_without_torchrun_says_how_to_start_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/integrate_hf_fsdp.py", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: examples/integrate_hf_fsdp.py runs one process per rank under torchrun (RANK and "
        "WORLD_SIZE are not set); start it with: torchrun --nproc-per-node 2 "
        f"examples/integrate_hf_fsdp.py --out {tmp_path / 'o'}"
    )


def test_a_missing_extra_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """torchtitan hidden from both ranks (sys.modules entry None, as if not installed)."""
    from nemo_moe_metrics.testing import free_port

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchtitan'] = None\n")
    env = {**_env(tmp_path), "PYTHONPATH": f"{hide}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", "examples/integrate_torchtitan.py", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours == [
        "error: examples/integrate_torchtitan.py needs torchtitan (torchtitan is not installed); "
        "install it with: pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 "
        "torch_checkpointing==0.1.1 einops==0.8.2 && pip install tyro==1.0.17 triton==3.7.1 (no "
        "extra: its own pins would break transformers; docs/en/torchtitan.md)"
    ], proc.stderr
    first_error = next(line for line in proc.stderr.splitlines() if "rror" in line)
    assert first_error == ours[0]  # before torchrun's own summary
    # torchrun's summary names the root cause with the same words (the rank's error file),
    # whichever rank exited first; no rank printed a traceback of its own.
    root = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and "needs torchtitan (torchtitan is not installed)" in root
    assert "MissingExtraError" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
