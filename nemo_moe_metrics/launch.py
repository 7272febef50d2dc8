"""Launch the per-rank entrypoint through nemo-run: local torchrun today, Slurm on a GPU cluster.

The same :func:`train_script` (``torchrun -m nemo_moe_metrics.train --recipe R --output-dir D``)
runs under :func:`local_executor` (CPU ranks with gloo) and :func:`slurm_executor` (GPU nodes
with NCCL). ``NEMORUN_HOME`` is pointed inside the run directory, so nothing is written to ``~``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nemo_moe_metrics import metric_names as names
from nemo_moe_metrics.config import ConfigError, load_recipe

NEMORUN_DIR = "nemo_run"


def check_world_size(recipe: Any, nproc: int) -> None:
    """Raise ConfigError, before any process starts, when ``nproc`` cannot hold the layout."""
    mcfg = recipe.policy.megatron_cfg
    model_parallel = mcfg.pipeline_model_parallel_size * mcfg.context_parallel_size
    if nproc < 1 or nproc % model_parallel or nproc % mcfg.expert_model_parallel_size:
        raise ConfigError(
            f"--nproc {nproc} does not fit the recipe's parallel layout (pipeline "
            f"{mcfg.pipeline_model_parallel_size} x context {mcfg.context_parallel_size}, expert "
            f"{mcfg.expert_model_parallel_size}); use a multiple of each, e.g. --nproc "
            f"{max(model_parallel, mcfg.expert_model_parallel_size)}, or override "
            "policy.megatron_cfg.expert_model_parallel_size"
        )


def run_dir_for(recipe_path: str | Path, overrides: list[str], output_dir: str | Path) -> Path:
    """``output_dir/<recipe name>``: where a run of this recipe writes (validates the recipe)."""
    recipe = load_recipe(recipe_path, overrides)
    return Path(output_dir).resolve() / recipe.name


def use_nemorun_home(path: str | Path) -> None:
    """Point nemo-run's home (experiment metadata, logs) at ``path``, here and in children."""
    import nemo_run.config as nemo_run_config

    os.environ["NEMORUN_HOME"] = str(path)
    nemo_run_config.set_nemorun_home(str(path))


def train_script(recipe_path: str | Path, overrides: list[str], run_dir: str | Path) -> Any:
    """A ``run.Script`` running ``python -m nemo_moe_metrics.train`` (paths passed as given)."""
    import nemo_run as run

    args = ["--recipe", str(recipe_path), "--output-dir", str(run_dir)]
    return run.Script(
        path="nemo_moe_metrics.train", m=True, entrypoint="python", args=args + list(overrides)
    )


def local_executor(nproc: int) -> Any:
    """``nproc`` ranks on this machine under torchrun (gloo on CPU, NCCL on GPUs)."""
    import nemo_run as run

    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    env = {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "OMP_NUM_THREADS": "1"}
    # Children import the package from where this process found it (editable or source tree).
    src_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, os.environ.get("PYTHONPATH")) if p)
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", env_vars=env)


def launch_local(
    recipe_path: str | Path,
    overrides: list[str],
    nproc: int,
    output_dir: str | Path,
) -> Path:
    """Train the recipe on ``nproc`` local torchrun ranks via nemo-run; returns the run directory.

    Blocks until the job ends; raises RuntimeError (naming the log) if it did not succeed.
    """
    import nemo_run as run

    check_world_size(load_recipe(recipe_path, overrides), nproc)
    run_dir = run_dir_for(recipe_path, overrides, output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    use_nemorun_home(run_dir / NEMORUN_DIR)
    # torchrun lives next to this interpreter; a venv used without activation lacks it on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    script = train_script(Path(recipe_path).resolve(), overrides, run_dir)
    with run.Experiment(run_dir.name, executor=local_executor(nproc), log_level="WARN") as exp:
        exp.add(script, name="train", tail_logs=False)
        exp.run(sequential=True, detach=False, tail_logs=False)
    # The experiment waits for its jobs when the block exits; Job.state is then final
    # (exp.status() is not supported for local jobs).
    states = [str(job.state) for job in exp.jobs]
    if not states or any("SUCCEEDED" not in s for s in states):
        logs = sorted((run_dir / NEMORUN_DIR).rglob("combined.log"), key=os.path.getmtime)
        where = f"; full log: {logs[-1]}" if logs else f"; see {run_dir / NEMORUN_DIR}"
        cause = _first_rank_error(logs[-1]) if logs else None
        raise RuntimeError(
            f"training job did not succeed (status {states or 'unknown'})"
            + (f"\n  {cause}" if cause else "")
            + where
        )
    return run_dir


def _first_rank_error(log: Path) -> str | None:
    # torchrun prefixes rank output with "[defaultN]:"; the first exception line names the cause.
    pattern = re.compile(r"^(?:\[default\d+\]:)?(\w+(?:Error|Exception)\b.*)$")
    for line in log.read_text(errors="replace").splitlines():
        m = pattern.match(line)
        if m and not m[1].startswith("ChildFailedError"):
            return m[1]
    return None


def slurm_executor(
    *,
    account: str,
    partition: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    time: str = "01:00:00",
    container_image: str | None = None,
    container_mounts: list[str] | None = None,
    job_dir: str | Path = "slurm_jobs",
    env_vars: dict[str, str] | None = None,
) -> Any:
    """A ``run.SlurmExecutor`` for GPU clusters: one torchrun per node, one rank per GPU.

    Submit from a login node (``LocalTunnel``); wrap in ``run.SSHTunnel`` to submit remotely.
    """
    import nemo_run as run

    executor = run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=1,  # torchrun spawns the per-GPU ranks itself
        gpus_per_node=gpus_per_node,
        time=time,
        container_image=container_image,
        container_mounts=list(container_mounts or []),
        tunnel=run.LocalTunnel(job_dir=str(Path(job_dir).resolve())),
        packager=run.GitArchivePackager(),  # ships the repository at HEAD to the cluster
        env_vars={"WANDB_MODE": "offline", **(env_vars or {})},
    )
    executor.launcher = "torchrun"
    executor.torchrun_nproc_per_node = gpus_per_node
    return executor


def slurm_dry_run(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    **executor_kwargs: Any,
) -> str:
    """The sbatch script and srun/torchrun command nemo-run would submit (nothing is submitted).

    ``recipe_path`` and ``output_dir`` are used as given: on the cluster they are read relative
    to the packaged code directory (the container's working directory).
    """
    from nemo_run.run.torchx_backend.launcher import CONSOLE

    # nemo-run prints the dry run on its rich console; capture it wide enough not to wrap.
    old_width = CONSOLE.width
    CONSOLE.width = 10_000
    try:
        with CONSOLE.capture() as captured:
            _slurm_experiment(recipe_path, overrides, output_dir, True, executor_kwargs)
    finally:
        CONSOLE.width = old_width
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


def slurm_submit(
    recipe_path: str | Path, overrides: list[str], output_dir: str | Path, **executor_kwargs: Any
) -> None:
    """Submit the recipe to Slurm (from a login node) and detach; see :func:`slurm_executor`."""
    _slurm_experiment(recipe_path, overrides, output_dir, False, executor_kwargs)


def _slurm_experiment(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    dryrun: bool,
    executor_kwargs: dict[str, Any],
) -> None:
    import nemo_run as run

    name = load_recipe(recipe_path, overrides).name
    kwargs = dict(executor_kwargs)
    job_dir = Path(kwargs.pop("job_dir", Path(output_dir) / name / "slurm_jobs"))
    use_nemorun_home(job_dir / NEMORUN_DIR)
    executor = slurm_executor(job_dir=job_dir, **kwargs)
    script = train_script(recipe_path, overrides, Path(output_dir) / name)
    with run.Experiment(name, executor=executor, log_level="WARN") as exp:
        exp.add(script, name="train", tail_logs=False)
        if dryrun:
            exp.dryrun(log=True, delete_exp_dir=True)
        else:
            exp.run(detach=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m nemo_moe_metrics.launch RECIPE [k=v ...] [--nproc N] [--output-dir D]``."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_moe_metrics.launch",
        description="Train a recipe on local torchrun ranks through nemo-run.",
    )
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--output-dir", default="runs", help="default runs/")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    try:
        run_dir = launch_local(args.recipe, args.overrides, args.nproc, args.output_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(run_dir)
    return 0


# What the live progress bar shows, from the latest JSONL line: (key, label, format).
PROGRESS_FIELDS: list[tuple[str, str, str]] = [
    (names.TRAIN_LOSS, "loss", "{:.4f}"),
    (names.TRAIN_REWARD, "reward", "{:.3f}"),  # GRPO: its on-policy loss is about 0
    (names.TOKENS_PER_SECOND, "tok/s", "{:.0f}"),
    (names.MAX_OVER_IDEAL, "max/ideal", "{:.2f}"),
]


def _read_new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    # Only whole lines: rank 0 may be mid-write when we look.
    if not path.is_file():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


def describe_step(row: dict[str, Any]) -> str:
    """The progress line's text for one step's metrics (fields missing from the row are skipped)."""
    parts = []
    for key, label, fmt in PROGRESS_FIELDS:
        value = row.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def run_with_progress(
    recipe_path: str | Path,
    overrides: list[str],
    nproc: int,
    output_dir: str | Path,
    console: Any | None = None,
    poll_s: float = 0.5,
) -> int:
    """Launch the recipe in a child process and show a rich progress bar fed by its JSONL.

    Returns the launcher's exit status; the launcher's own output goes to ``<run>/launch.log``.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    console = console or Console()
    recipe = load_recipe(recipe_path, overrides)  # fail fast, before any process starts
    check_world_size(recipe, nproc)
    run_dir = Path(output_dir).resolve() / recipe.name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)  # never show a previous run's steps
    log_path = run_dir / "launch.log"
    cmd = [sys.executable, "-m", "nemo_moe_metrics.launch", str(recipe_path)]
    cmd += ["--nproc", str(nproc), "--output-dir", str(Path(output_dir).resolve()), *overrides]
    env = dict(os.environ)
    src_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    offset, last = 0, {}
    with (
        log_path.open("w") as log,
        Progress(
            TextColumn("[bold]{task.fields[name]}"),
            BarColumn(),
            # Piped output is 80 columns: the bar and the metrics give way, never the counts
            # or the elapsed time (which rich would otherwise cut to "0:0…").
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=3)),
            TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
            TextColumn(
                "{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")
            ),
            console=console,
        ) as progress,
    ):
        task = progress.add_task(
            "starting ranks...", total=recipe.training.max_steps, name=recipe.name
        )
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:
            done = proc.poll() is not None
            rows, offset = _read_new_lines(metrics_path, offset)
            if rows:
                last = rows[-1]
                progress.update(task, completed=last["step"] + 1, description=describe_step(last))
            if done:
                break
            time.sleep(poll_s)
    if proc.returncode != 0:
        tail = log_path.read_text().splitlines()[-15:]
        console.print(f"[red]run failed (exit {proc.returncode}); last lines of {log_path}:")
        console.print("\n".join(tail), markup=False, highlight=False)
        return proc.returncode
    console.print(f"[green]done[/green]: {run_dir}  (last step {last.get('step')})", soft_wrap=True)
    if metrics_path.is_file():
        from nemo_moe_metrics.report import render_report

        # The pictures and the summary a user looks at first.
        # soft_wrap: whole lines, never cut at the console width (80 columns when piped).
        console.print(render_report(run_dir), markup=False, highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
