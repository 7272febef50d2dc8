"""The local launch through nemo-run: torchrun ranks on this machine (gloo on CPU, NCCL on
GPUs), and ``python -m nemo_moe_metrics.launch`` (the launch process ``run`` starts).

The same :func:`train_script` (``torchrun -m nemo_moe_metrics.train --recipe R --output-dir D``)
runs under :func:`local_executor` and, on a cluster, :func:`~.slurm_submit.slurm_executor`.
``NEMORUN_HOME`` is pointed inside the run directory, so nothing is written to ``~``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import ConfigError, load_recipe
from nemo_moe_metrics.config.preflight import preflight
from nemo_moe_metrics.launch.checks import run_dir_for
from nemo_moe_metrics.launch.failure_report import latest_rank_log
from nemo_moe_metrics.launch.failures import (
    first_rank_failure,
)
from nemo_moe_metrics.launch.supervise import SRC_ROOT, own_children
from nemo_moe_metrics.launch.train_args import ARGV_ENV, ARGV_FROM_ENV
from nemo_moe_metrics.run_dir.lock import TOKEN_ENV, RunDirLock, this_command
from nemo_moe_metrics.run_dir.names import NEMORUN_DIR


def use_nemorun_home(path: str | Path) -> None:
    """Point nemo-run's home (experiment metadata, logs) at ``path``, here and in children."""
    import nemo_run.config as nemo_run_config

    os.environ["NEMORUN_HOME"] = str(path)
    nemo_run_config.set_nemorun_home(str(path))


def train_script(
    recipe_path: str | Path, overrides: list[str], run_dir: str | Path, *, shell: bool = True
) -> Any:
    """A ``run.Script`` running ``python -m nemo_moe_metrics.train`` (paths passed as given).

    ``shell``: whether a shell reads the command (an sbatch script: nemo-run quotes each
    argument for it, right there) or not (a ``run.LocalExecutor``: torchrun is started with a
    list, where those quotes would stay in the text). Without a shell the arguments travel in
    the script's environment as a JSON list (:mod:`nemo_moe_metrics.launch.train_args`), so each
    reaches the ranks byte for byte; the command line holds only a flag saying so.
    """
    import nemo_run as run

    args = ["--recipe", str(recipe_path), "--output-dir", str(run_dir), *overrides]
    if shell:
        return run.Script(path="nemo_moe_metrics.train", m=True, entrypoint="python", args=args)
    return run.Script(
        path="nemo_moe_metrics.train",
        m=True,
        entrypoint="python",
        args=[ARGV_FROM_ENV],
        env={ARGV_ENV: json.dumps(args)},
    )


def local_executor(nproc: int) -> Any:
    """``nproc`` ranks on this machine under torchrun (gloo on CPU, NCCL on GPUs); give it a
    :func:`train_script` made with ``shell=False``."""
    import nemo_run as run

    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    env = {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_ROOT, os.environ.get("PYTHONPATH")) if p)
    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", env_vars=env)


def launch_local(
    recipe_path: str | Path,
    overrides: list[str],
    nproc: int,
    output_dir: str | Path,
) -> Path:
    """Train the recipe on ``nproc`` local torchrun ranks via nemo-run; returns the run directory.

    Blocks until the job ends; raises RuntimeError (naming the log) if it did not succeed.
    Started by ``nemo-moe-metrics run``, it works under that command's lock of the run
    directory; started alone, it takes the lock itself for as long as the job runs.
    """
    preflight(load_recipe(recipe_path, overrides), nproc)
    run_dir = run_dir_for(recipe_path, overrides, output_dir)
    if os.environ.get(TOKEN_ENV):  # the owner (`run`) holds the lock; rank 0 joins it
        return _launch_local(recipe_path, overrides, nproc, run_dir)
    with RunDirLock(run_dir, command=this_command()) as lock:
        os.environ[TOKEN_ENV] = lock.token  # for the ranks (nemo-run passes the environment)
        try:
            return _launch_local(recipe_path, overrides, nproc, run_dir)
        finally:
            del os.environ[TOKEN_ENV]


def _launch_local(recipe_path: str | Path, overrides: list[str], nproc: int, run_dir: Path) -> Path:
    import nemo_run as run

    run_dir.mkdir(parents=True, exist_ok=True)
    use_nemorun_home(run_dir / NEMORUN_DIR)
    # torchrun lives next to this interpreter; a venv used without activation lacks it on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    script = train_script(Path(recipe_path).resolve(), overrides, run_dir, shell=False)
    executor = local_executor(nproc)
    with run.Experiment(run_dir.name, executor=executor, log_level="WARN") as exp:
        exp.add(script, name="train", tail_logs=False)
        exp.run(sequential=True, detach=False, tail_logs=False)
    # The experiment waits for its jobs when the block exits; Job.state is then final
    # (exp.status() is not supported for local jobs).
    states = [str(job.state) for job in exp.jobs]
    if not states or any("SUCCEEDED" not in s for s in states):
        log = latest_rank_log(run_dir)
        failure = first_rank_failure(log) if log else None
        raise RuntimeError(
            f"training job did not succeed (status {states or 'unknown'})"
            + (f"\n{failure.describe()}" if failure else "")
            + (f"\nrank log: {log}" if log else f"\nsee {run_dir / NEMORUN_DIR}")
        )
    return run_dir


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
    own_children()
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
