"""Launch the per-rank entrypoint through nemo-run: local torchrun today, Slurm on a GPU cluster.

The same :func:`train_script` (``torchrun -m nemo_moe_metrics.train --recipe R --output-dir D``)
runs under :func:`local_executor` (CPU ranks with gloo) and :func:`slurm_executor` (GPU nodes
with NCCL). ``NEMORUN_HOME`` is pointed inside the run directory, so nothing is written to ``~``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_moe_metrics import metric_names as names
from nemo_moe_metrics import processes
from nemo_moe_metrics.config import ConfigError, Recipe, load_recipe
from nemo_moe_metrics.extras import check_extra
from nemo_moe_metrics.failures import (
    LAST_WORDS_ENV,
    first_rank_failure,
    launcher_death_lines,
    rank_failure_lines,
    read_failures,
    torchelastic_last_words,
)
from nemo_moe_metrics.job_watch import JobWatch
from nemo_moe_metrics.preflight import preflight
from nemo_moe_metrics.run_dir import TOKEN_ENV, RunDirError, RunDirLock, this_command
from nemo_moe_metrics.run_dir_policy import check_before_lock, prepare_run_dir
from nemo_moe_metrics.run_files import LAUNCH_LOG, NEMORUN_DIR
from nemo_moe_metrics.train_args import ARGV_ENV, ARGV_FROM_ENV


def check_world_size(recipe: Any, nproc: int) -> None:
    """Raise ConfigError, before any process starts, when the recipe cannot run on ``nproc`` ranks.

    Kept for callers of the old name; the checks are :func:`nemo_moe_metrics.preflight.preflight`.
    """
    preflight(recipe, nproc)


def check_launch_extras(recipe: Recipe) -> None:
    """Raise MissingExtraError before launching when an extra the recipe needs is missing."""
    check_extra("launch", "nemo-moe-metrics run")
    check_extra("megatron", "nemo-moe-metrics run (the megatron-core policy worker)")
    if recipe.logger.tensorboard_enabled:
        check_extra("tensorboard", "logger.tensorboard_enabled=true")
    if recipe.logger.wandb_enabled and recipe.logger.wandb_mode != "disabled":
        check_extra("wandb", "logger.wandb_enabled=true")


def check_resume_has_steps_left(run_dir: Path, recipe: Recipe, recipe_path: str | Path) -> None:
    """Raise ConfigError when the run to resume already reached ``training.max_steps``."""
    from nemo_moe_metrics.sinks import read_resume_state

    state = read_resume_state(run_dir)
    max_steps = recipe.training.max_steps
    if state.last_step is None or state.next_step < max_steps:
        return
    raise ConfigError(
        f"--resume: {run_dir} is already at training.max_steps={max_steps} (last logged step "
        f"{state.last_step}), so there is nothing left to train. To train further, raise "
        f"max_steps, e.g. nemo-moe-metrics run {recipe_path} training.max_steps={2 * max_steps} "
        "--resume; to look at it: nemo-moe-metrics report " + str(run_dir)
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


def train_script(
    recipe_path: str | Path, overrides: list[str], run_dir: str | Path, *, shell: bool = True
) -> Any:
    """A ``run.Script`` running ``python -m nemo_moe_metrics.train`` (paths passed as given).

    ``shell``: whether a shell reads the command (an sbatch script: nemo-run quotes each
    argument for it, right there) or not (the local executor starts torchrun with a list,
    where those quotes would stay in the text). Without a shell the arguments travel in the
    environment (:data:`~nemo_moe_metrics.train.ARGV_ENV`, :func:`local_executor`), so each
    reaches the ranks byte for byte; the command line holds only a flag saying so.
    """
    import nemo_run as run

    args = ["--recipe", str(recipe_path), "--output-dir", str(run_dir), *overrides]
    return run.Script(
        path="nemo_moe_metrics.train",
        m=True,
        entrypoint="python",
        args=args if shell else [ARGV_FROM_ENV],
    )


def local_executor(nproc: int, train_argv: list[str] | None = None) -> Any:
    """``nproc`` ranks on this machine under torchrun (gloo on CPU, NCCL on GPUs);
    ``train_argv``: the ranks' arguments, passed in the environment (see :func:`train_script`)."""
    import nemo_run as run

    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    env = {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "OMP_NUM_THREADS": "1"}
    if train_argv is not None:
        env[ARGV_ENV] = json.dumps(train_argv)
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
    argv = ["--recipe", str(Path(recipe_path).resolve()), "--output-dir", str(run_dir), *overrides]
    executor = local_executor(nproc, train_argv=argv)
    with run.Experiment(run_dir.name, executor=executor, log_level="WARN") as exp:
        exp.add(script, name="train", tail_logs=False)
        exp.run(sequential=True, detach=False, tail_logs=False)
    # The experiment waits for its jobs when the block exits; Job.state is then final
    # (exp.status() is not supported for local jobs).
    states = [str(job.state) for job in exp.jobs]
    if not states or any("SUCCEEDED" not in s for s in states):
        log = _latest_rank_log(run_dir)
        failure = first_rank_failure(log) if log else None
        raise RuntimeError(
            f"training job did not succeed (status {states or 'unknown'})"
            + (f"\n{failure.describe()}" if failure else "")
            + (f"\nrank log: {log}" if log else f"\nsee {run_dir / NEMORUN_DIR}")
        )
    return run_dir


def _first_rank_error(log: Path) -> str | None:
    """``Type: message`` of the first exception a rank logged (None when there is none)."""
    failure = first_rank_failure(log)
    return failure.exception if failure else None


def _latest_rank_log(run_dir: Path, since: float = 0.0) -> Path | None:
    logs = [p for p in (run_dir / NEMORUN_DIR).rglob("combined.log") if p.stat().st_mtime >= since]
    return max(logs, key=os.path.getmtime) if logs else None


def _status_hint(run_dir: Path, log: Path) -> str | None:
    """``NEMORUN_HOME=... nemo experiment status ID``: works as printed (checked)."""
    home = run_dir / NEMORUN_DIR
    parts = log.relative_to(home / "experiments").parts if home in log.parents else ()
    if len(parts) < 2 or not shutil.which("nemo", path=str(Path(sys.executable).parent)):
        return None
    nemo = Path(sys.executable).parent / "nemo"
    return (
        f"NEMORUN_HOME={shlex.quote(str(home))} {shlex.quote(str(nemo))} "
        f"experiment status {parts[1]}"
    )


LAUNCHERS = ("torchrun", "srun")
#: Seconds between two looks at the job's processes for stopped ones (job_watch.py).
WATCH_EVERY_S = 2.0


def slurm_executor(
    *,
    account: str,
    partition: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    ranks_per_node: int | None = None,
    launcher: str = "torchrun",
    rdzv_port: int = 29500,
    time: str = "01:00:00",
    container_image: str | None = None,
    container_mounts: list[str] | None = None,
    job_dir: str | Path = "slurm_jobs",
    env_vars: dict[str, str] | None = None,
) -> Any:
    """A ``run.SlurmExecutor`` for ``nodes`` x ``ranks_per_node`` ranks (default: one per GPU).

    ``launcher="torchrun"``: one Slurm task per node runs torchrun, which starts that node's
    ranks (c10d rendezvous at the first node's address, port ``rdzv_port``).
    ``launcher="srun"``: one Slurm task per rank; each reads its rank from ``SLURM_PROCID``
    (:func:`nemo_moe_metrics.slurm.rank_env_from_slurm`) and meets the others at
    ``MASTER_ADDR`` (the first node) and ``MASTER_PORT`` (``rdzv_port``).
    ``gpus_per_node=0``: CPU nodes with gloo, ``ranks_per_node`` ranks each, one thread per rank.
    Without a container image the job uses the submitting environment (sbatch exports it) with
    this interpreter's ``bin/`` first on ``PATH``. Submit from a login node (``LocalTunnel``,
    nemo-run's files under ``job_dir``); wrap in ``run.SSHTunnel`` to submit remotely.
    """
    import nemo_run as run

    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    per_node = _ranks_per_node({"ranks_per_node": ranks_per_node, "gpus_per_node": gpus_per_node})
    env = {"WANDB_MODE": "offline"}
    if not gpus_per_node:
        env["OMP_NUM_THREADS"] = "1"  # as `run` on CPU: more threads per rank oversubscribe
    if container_image is None:
        env["PATH"] = f"{Path(sys.executable).parent}:$PATH"  # python and torchrun of this env
    if launcher == "srun":
        env["MASTER_ADDR"] = "$head_node_ip"  # nemo-run's script sets it before the srun line
        env["MASTER_PORT"] = str(rdzv_port)
    job_dir = Path(job_dir).resolve()
    torchrun = launcher == "torchrun"
    executor = run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=1 if torchrun else per_node,
        gpus_per_node=gpus_per_node or None,
        cpus_per_task=(per_node if torchrun else 1) if not gpus_per_node else None,
        time=time,
        container_image=container_image,
        container_mounts=list(container_mounts or []),
        # With a LocalTunnel the experiment directory nemo-run writes (NEMORUN_HOME/experiments)
        # is the one sbatch reads, so NEMORUN_HOME is job_dir itself (_slurm_experiment).
        tunnel=run.LocalTunnel(job_dir=str(job_dir / "experiments")),
        packager=run.GitArchivePackager(),  # ships the repository at HEAD to the cluster
        env_vars={**env, **(env_vars or {})},
        srun_args=None if torchrun else ["--label"],  # "N: " before each rank's lines
        # nemo-run exports SLURM_UNBUFFEREDIO=1; unbuffered, srun labels arbitrary chunks and
        # cuts a rank's traceback mid-line. Line-buffered output keeps one label per line.
        setup_lines=None if torchrun else "unset SLURM_UNBUFFEREDIO",
        poll_estimated_start_time=False,  # follow_job reports the state instead
    )
    if torchrun:
        executor.launcher = run.Torchrun(rdzv_port=rdzv_port)
        executor.torchrun_nproc_per_node = per_node
    return executor


def slurm_dry_run(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    **executor_kwargs: Any,
) -> str:
    """The sbatch command and script nemo-run would submit, readable (nothing is submitted).

    Long shell lines (the srun/torchrun command) are folded with ``\\`` continuations, so no line
    is longer than about 100 characters. Nothing is written: nemo-run's bookkeeping goes to a
    temporary directory that is removed. The script shows what :func:`slurm_submit` submits:
    the recipe relative to the packaged repository's root (or absolute, outside it) and the run
    directory resolved here.
    """
    import contextlib
    import io

    saved = os.environ.get("NEMORUN_HOME")
    # nemo-run narrates on its console ("Entering Experiment", launcher notes): not the dry run.
    chatter = io.StringIO()
    with (
        tempfile.TemporaryDirectory(prefix="nemo_moe_metrics_dryrun_") as tmp,
        contextlib.redirect_stdout(chatter),
    ):
        try:
            exp = _slurm_experiment(
                recipe_path, overrides, output_dir, True, executor_kwargs, Path(tmp)
            )
        finally:
            if saved is None:
                os.environ.pop("NEMORUN_HOME", None)
            else:
                use_nemorun_home(saved)
    request = exp.jobs[0]._dryrun_info.request
    submit = " ".join([*request.launch_cmd, "$SBATCH_SCRIPT"])
    script = "\n".join(fold_shell_line(line) for line in request.materialize().splitlines())
    return f"# submit with:\n{submit}\n\n# SBATCH_SCRIPT:\n{script.rstrip()}\n"


_SHELL_WORD = re.compile(r"""(?:[^\s'"]+|'[^']*'|"(?:[^"\\]|\\.)*")+""")


def fold_shell_line(line: str, width: int = 100) -> str:
    """Fold a long shell command at word boundaries with ``\\`` continuations (quotes kept whole).

    An option stays on one line with its value; the launched program (``torchrun``, ``python``)
    starts a new line. Comments (``#SBATCH`` directives included, which cannot be continued)
    and lines that are not plain words stay as they are.
    """
    if len(line) <= width or line.lstrip().startswith("#"):
        return line
    indent = line[: len(line) - len(line.lstrip())]
    words = _SHELL_WORD.findall(line)
    if " ".join(words) != line.strip():  # a heredoc or odd quoting: leave it
        return line
    programs = ("torchrun", "python", "python3")
    parts: list[str] = []
    for word in words:
        prev = parts[-1] if parts else ""
        takes_value = prev.startswith("-") and " " not in prev and "=" not in prev
        if takes_value and not word.startswith("-") and word not in programs:
            parts[-1] = f"{prev} {word}"
        else:
            parts.append(word)
    out: list[str] = []
    current = indent + parts[0]
    for part in parts[1:]:
        if len(current) + 1 + len(part) > width or part in programs:
            out.append(current + " \\")
            current = indent + "    " + part
        else:
            current += " " + part
    out.append(current)
    return "\n".join(out)


def slurm_submit(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    **executor_kwargs: Any,
) -> Any:
    """Submit the recipe to Slurm from a login node and return its record at once.

    The run directory ``output_dir/<recipe name>`` is resolved here and must be on a filesystem
    the compute nodes share; it goes through :func:`prepare_run_dir` as for ``run`` (one run per
    directory; ``resume`` continues it with ``logger.resume=true``, ``overwrite`` deletes it).
    Returns a :class:`nemo_moe_metrics.slurm.SubmittedJob`, also saved under
    ``job_dir/submitted/`` for :func:`nemo_moe_metrics.slurm.follow_job`.
    """
    from nemo_moe_metrics.preflight import slurm_rank_words
    from nemo_moe_metrics.slurm import SubmittedJob

    recipe = load_recipe(recipe_path, overrides)
    nodes = executor_kwargs.get("nodes", 1)
    per_node = _ranks_per_node(executor_kwargs)
    preflight(recipe, nodes * per_node, slurm_rank_words(nodes, per_node, _cpu(executor_kwargs)))
    _recipe_for_job(recipe_path, check_committed=True)
    run_dir = Path(output_dir).resolve() / recipe.name
    # Held while the directory is checked and cleared: a live run refuses the submission. The
    # job takes the lock itself for its lifetime (train.own_run_dir), on the compute node.
    notes: list[str | None] = []
    claim_run_dir(run_dir, resume=resume, overwrite=overwrite, say=notes.append).release()
    notes.append(_uncommitted_note())
    if resume:
        check_resume_has_steps_left(run_dir, recipe, recipe_path)
        overrides = [*overrides, "logger.resume=true"]
    metrics = run_dir / "metrics.jsonl"
    offset = metrics.stat().st_size if metrics.is_file() else 0
    exp = _slurm_experiment(recipe_path, overrides, output_dir, False, executor_kwargs)
    job = exp.jobs[0]
    record = SubmittedJob(
        job_id=str(job.handle).rsplit("/", 1)[-1],
        name=recipe.name,
        run_dir=str(run_dir),
        job_files=str(job.executor.job_details.folder),
        max_steps=recipe.training.max_steps,
        jsonl_offset=offset,
        nodes=nodes,
        ranks_per_node=per_node,
        launcher=executor_kwargs.get("launcher", "torchrun"),
        algorithm=recipe.algorithm,
        notes=[n for n in notes if n],
    )
    record.save(_job_dir(executor_kwargs))
    return record


def _uncommitted_note() -> str | None:
    """A note when the repository nemo-run packages (at HEAD) has uncommitted changes."""
    changed = _git("status", "--porcelain", "--untracked-files=no")
    if not changed:
        return None
    head = _git("rev-parse", "--short", "HEAD")
    return (
        f"note: the job runs the repository at HEAD ({head}); uncommitted changes to "
        f"{len(changed.splitlines())} file(s) are not part of it"
    )


def _ranks_per_node(executor_kwargs: dict[str, Any]) -> int:
    per_node = executor_kwargs.get("ranks_per_node") or executor_kwargs.get("gpus_per_node", 8)
    if per_node < 1:
        raise ConfigError(
            "--gpus-per-node 0 runs on CPU nodes: say how many ranks each runs with "
            "--ranks-per-node N"
        )
    return per_node


def _cpu(executor_kwargs: dict[str, Any]) -> bool:
    return executor_kwargs.get("gpus_per_node", 8) == 0


def _job_dir(executor_kwargs: dict[str, Any]) -> Path:
    return Path(executor_kwargs.get("job_dir") or "slurm_jobs").resolve()


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", *args], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _recipe_for_job(recipe_path: str | Path, check_committed: bool = False) -> str:
    """The recipe path as the job reads it.

    nemo-run ships the git repository this command runs in, at HEAD, and the job starts in that
    copy: a recipe inside the repository is passed relative to its root (and, when submitting,
    must be committed as it is, or the job would train another recipe); one outside it is
    passed as an absolute path, read on the shared filesystem.
    """
    path = Path(recipe_path).resolve()
    top = _git("rev-parse", "--show-toplevel")
    if top is None or not path.is_relative_to(Path(top).resolve()):
        return str(path)
    relative = path.relative_to(Path(top).resolve())
    if check_committed and _git("status", "--porcelain", "--", str(path)):
        raise ConfigError(
            f"{relative} is not committed as it is: the job runs the repository {top} at HEAD "
            "(nemo-run packages it with git archive), so it would train another recipe; "
            "commit the recipe, or copy it outside the repository (its absolute path is then "
            "read on the shared filesystem)"
        )
    return str(relative)


def _check_paths_survive_nemo_run(*paths: Path) -> None:
    # Without a container, nemo-run rewrites every "/nemo_run" in the sbatch script to the job
    # directory (it stands for the container's mount point), which breaks paths containing it.
    from nemo_run.config import RUNDIR_NAME

    for path in paths:
        if f"/{RUNDIR_NAME}" in str(path):
            raise ConfigError(
                f"{path} contains '/{RUNDIR_NAME}', which nemo-run rewrites in the sbatch script "
                "when no container image is given; choose a --job-dir and --output-dir whose "
                f"path has no '/{RUNDIR_NAME}'"
            )


def _slurm_experiment(
    recipe_path: str | Path,
    overrides: list[str],
    output_dir: str | Path,
    dryrun: bool,
    executor_kwargs: dict[str, Any],
    nemorun_home: Path | None = None,
) -> Any:
    import contextlib
    import importlib
    import io

    import nemo_run as run
    from invoke.exceptions import UnexpectedExit

    from nemo_moe_metrics.preflight import slurm_rank_words
    from nemo_moe_metrics.slurm import SlurmError

    recipe = load_recipe(recipe_path, overrides)
    nodes, per_node = executor_kwargs.get("nodes", 1), _ranks_per_node(executor_kwargs)
    preflight(recipe, nodes * per_node, slurm_rank_words(nodes, per_node, _cpu(executor_kwargs)))
    name = recipe.name
    kwargs = dict(executor_kwargs)
    # Slurm bookkeeping (sbatch script, logs, packaged code) lives apart from any run directory.
    job_dir = _job_dir(kwargs)
    kwargs.pop("job_dir", None)
    # The run directory is resolved where the command runs: the job starts in its own copy of
    # the code, so a relative path would put every job (and a resumed one) somewhere else.
    output_root = Path(output_dir).resolve()
    if kwargs.get("container_image"):
        mount = f"{output_root}:{output_root}"
        kwargs["container_mounts"] = [*(kwargs.get("container_mounts") or []), mount]
    else:
        _check_paths_survive_nemo_run(job_dir, output_root)
    use_nemorun_home(nemorun_home or job_dir)
    if not dryrun:
        # nemo-run's job-id index is a path taken from NEMORUN_HOME when the module is imported.
        scheduler = importlib.import_module("nemo_run.run.torchx_backend.schedulers.slurm")
        scheduler.SLURM_JOB_DIRS = str(job_dir / ".slurm_jobs")
    executor = slurm_executor(job_dir=job_dir, **kwargs)
    # The Slurm job is named after the recipe (nemo-run's default is "<account>-<account>.").
    executor.job_details.job_name = name
    script = train_script(_recipe_for_job(recipe_path), overrides, output_root / name)
    # nemo-run narrates on its console (stdout) and, leaving a detached experiment, asks sacct
    # for the status (an error without accounting): not what this command shows.
    chatter = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(chatter),
            run.Experiment(
                name,
                executor=executor,
                log_level="WARN",
                skip_status_at_exit=True,
                enable_goodbye_message=False,
            ) as exp,
        ):
            exp.add(script, name="train", tail_logs=False)
            if dryrun:
                exp.dryrun(log=False, delete_exp_dir=True)
            else:
                exp.run(detach=True)
    except UnexpectedExit as err:  # sbatch, or git/tar while packaging, said no
        said = (err.result.stderr or err.result.stdout or "").strip()
        command = err.result.command
        what = "sbatch refused the job" if command.startswith("sbatch") else f"{command} failed"
        raise SlurmError(f"{what}: {said}") from None
    return exp


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
    _own_children()
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


def _own_children() -> None:
    """This launch process stops its job (torchrun and the ranks, each in a session of their
    own) on SIGTERM, SIGINT or SIGHUP, and gets SIGTERM when ``nemo-moe-metrics run`` that
    started it dies (even by SIGKILL)."""
    launcher = os.environ.get(processes.LAUNCHER_ENV)
    if launcher:
        processes.die_with_parent(int(launcher.partition(":")[0]))

    stopping: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if stopping:  # already stopping (a second signal): that one finishes the job
            return
        stopping.append(signum)
        name = signal.Signals(signum).name
        print(f"launcher: {name}: stopping torchrun and the ranks", file=sys.stderr, flush=True)
        processes.stop_descendants(grace_s=10.0)
        os._exit(processes.Interrupted(signum).exit_status)

    for sig in processes.SIGNAL_EXIT:
        signal.signal(sig, stop)


# What the live progress bar shows, from the latest JSONL line: (key, label, format).
PROGRESS_FIELDS: list[tuple[str, str, str]] = [
    (names.TRAIN_LOSS, "loss", "{:.4f}"),
    (names.TRAIN_REWARD, "reward", "{:.3f}"),  # GRPO: its on-policy loss is about 0
    (names.TOKENS_PER_SECOND, "tok/s", "{:.0f}"),
    (names.MAX_OVER_IDEAL, "max/ideal", "{:.2f}"),
]


def _read_new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    # Only whole lines: rank 0 may be mid-write when we look.
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:  # not there yet, or unreadable for now: the bar waits
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line (a crash mid-write): the next resume cuts it
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows, offset + end


# GRPO's loss is the clipped policy-gradient surrogate: on-policy its value is about 0 while its
# gradient is not, so the progress line shows the reward first and labels the loss.
GRPO_FIELDS: list[tuple[str, str, str]] = [
    (names.TRAIN_REWARD, "reward", "{:.3f}"),
    (names.TRAIN_LOSS, "pg-loss", "{:.4f}"),
    (names.TOKENS_PER_SECOND, "tok/s", "{:.0f}"),
    (names.MAX_OVER_IDEAL, "max/ideal", "{:.2f}"),
]
GRPO_LOSS_NOTE = (
    "GRPO: reward is what improves; pg-loss is the clipped policy-gradient loss, about 0 "
    "on-policy by construction (its gradient is not 0), so a pg-loss near 0 is expected"
)
# Piped output (a log file, `| tee`): rich assumes 80 columns and would cut the metrics.
PIPED_WIDTH = 160


def describe_step(row: dict[str, Any], algorithm: str | None = None) -> str:
    """The progress line's text for one step's metrics (fields missing from the row are skipped).

    ``algorithm="grpo"`` puts the reward first and labels the loss ``pg-loss`` (see
    :data:`GRPO_LOSS_NOTE`).
    """
    parts = []
    for key, label, fmt in GRPO_FIELDS if algorithm == "grpo" else PROGRESS_FIELDS:
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
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> int:
    """Launch the recipe in a child process and show a rich progress bar fed by its JSONL.

    Before anything starts: the recipe, its layout on ``nproc`` ranks (:mod:`.preflight`), the
    extras it needs and the run directory (one run per directory, see :func:`prepare_run_dir`)
    are checked, and the directory's lock is taken (:class:`~.run_dir.RunDirLock`: a second
    run on a live directory is refused naming its holder). This process owns the job it starts
    (:mod:`.processes`): Ctrl-C, SIGTERM or SIGHUP stop torchrun and every rank and return
    128 + the signal (130 for Ctrl-C) after one line; ``kill -9`` of it stops them too. Returns
    the launcher's exit status; its own output goes to ``<run>/launch.log``; on failure the
    failing rank's first error is printed.
    """
    recipe = load_recipe(recipe_path, overrides)  # fail fast, before any process starts
    preflight(recipe, nproc)
    check_launch_extras(recipe)
    console = _console(console)
    run_dir = Path(output_dir).resolve() / recipe.name
    with claim_run_dir(
        run_dir, resume=resume, overwrite=overwrite, say=console_say(console)
    ) as lock:
        if resume:
            _prepare_resume(run_dir, recipe, recipe_path, console)
            overrides = [*overrides, "logger.resume=true"]
        where = ["--nproc", str(nproc), "--output-dir", str(Path(output_dir).resolve())]
        cmd = [sys.executable, "-m", "nemo_moe_metrics.launch", str(recipe_path), *where]
        with tempfile.TemporaryDirectory(prefix="nemo_moe_metrics_run_") as tmp:
            job = _Job(cmd + overrides, run_dir, recipe, _child_env(lock.token), resume)
            job.env[LAST_WORDS_ENV] = job.last_words = str(Path(tmp) / "rank_errors.jsonl")
            status = job.supervise(console, poll_s)
            if status is not None:  # interrupted: the whole job is stopped
                user = [o for o in overrides if o != "logger.resume=true"]
                again = ["nemo-moe-metrics", "run", str(recipe_path), *user, *where, "--resume"]
                _say(console, job.interrupted_line(status, shlex.join(again)))
                return status
            return job.finish(console)


def claim_run_dir(
    run_dir: Path, *, resume: bool, overwrite: bool, say: Callable[[str], None]
) -> RunDirLock:
    """Take ``run_dir``'s lock and make it ready for the run (:mod:`.run_dir_policy`), saying
    the notes; the lock, held. A directory that cannot be made or written (no permission, a
    read-only file system, a file in the way, a name too long) is a :class:`RunDirError`
    naming the path and the error, never a traceback."""
    try:
        # Said before the lock file would be created: a directory that is not a run's, and a
        # --resume of a directory that does not exist.
        check_before_lock(run_dir, resume=resume, overwrite=overwrite)
        if resume and not run_dir.is_dir():
            prepare_run_dir(run_dir, resume=True)
        lock = RunDirLock(run_dir, command=this_command()).acquire()  # before any write
    except OSError as err:
        raise RunDirError(_unusable(run_dir, err)) from None
    try:
        for note in lock.notes:
            say(note)
        note = prepare_run_dir(
            run_dir, resume=resume, overwrite=overwrite, earlier_lock=lock.previous
        )
        lock.mark_run()
    except OSError as err:
        lock.release()
        raise RunDirError(_unusable(run_dir, err)) from None
    except BaseException:
        lock.release()
        raise
    if note:
        say(note)
    return lock


def _unusable(run_dir: Path, err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, "error")
    where = err.filename or run_dir
    return (
        f"cannot use the run directory {run_dir}: {where}: {err.strerror or err} ({name}). "
        f"Choose a --output-dir that this user can write (and a shorter one when the name is "
        f"too long), or fix that path"
    )


def console_say(console: Any) -> Callable[[str], None]:
    """A function printing one whole line on ``console`` (paths stay whole, to copy)."""
    return lambda text: _say(console, text)


def _console(console: Any | None) -> Any:
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal and console.width < PIPED_WIDTH:
        console.width = PIPED_WIDTH  # whole progress lines in a log, never cut at 80 columns
    return console


def _say(console: Any, text: str) -> None:
    # soft_wrap: paths and commands stay whole lines, to copy and paste.
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _prepare_resume(run_dir: Path, recipe: Recipe, recipe_path: str | Path, console: Any) -> None:
    """Make the records agree (what was cut and why is printed), then check steps are left."""
    from nemo_moe_metrics.sinks import ResumeError, prepare_resume

    try:
        _, notes = prepare_resume(run_dir, table_every=recipe.logger.table_every)
    except ResumeError as err:
        raise ConfigError(str(err)) from None
    for note in notes:
        _say(console, f"resume: {note}")
    check_resume_has_steps_left(run_dir, recipe, recipe_path)


def _child_env(token: str) -> dict[str, str]:
    env = dict(os.environ)
    src_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    # The ranks end when this process does (processes.watch_launcher); rank 0 joins the lock.
    env[processes.LAUNCHER_ENV] = processes.identity()
    env[TOKEN_ENV] = token
    return env


@dataclass
class _Job:
    """The launch process ``run`` starts and watches, and what it printed."""

    cmd: list[str]
    run_dir: Path
    recipe: Recipe
    env: dict[str, str]
    resume: bool
    returncode: int | None = None
    started: float = 0.0
    last: dict[str, Any] | None = None
    stopped: int = 0  # processes stopped after a signal
    last_words: str | None = None  # where the ranks record their errors (failures.py)
    alerts: Any = None  # moe.alerts.AlertConsole: the alert lines rank 0 recorded, on the console
    watch: JobWatch | None = None  # stopped ranks and launchers (job_watch.py)
    gave_up: str | None = None  # why run stopped a job whose launcher stopped answering

    def _alert_console(self) -> Any:
        if self.alerts is None:
            from nemo_moe_metrics.moe.alerts import AlertConsole

            self.alerts = AlertConsole(per_step=self.recipe.logger.alerts.max_lines_per_step)
        return self.alerts

    def supervise(self, console: Any, poll_s: float) -> int | None:
        """Run the launch process with a progress bar until it ends: None, or the exit status
        of a stopping signal after the whole job was stopped."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Column

        metrics_path = self.run_dir / "metrics.jsonl"
        # Show this run's steps only: a resumed run appends to the file it continues.
        offset = metrics_path.stat().st_size if metrics_path.is_file() else 0
        self.started = time.time()
        if self.recipe.algorithm == "grpo":
            _say(console, GRPO_LOSS_NOTE)
        processes.become_subreaper()  # orphans of the job stay findable (and stoppable) here
        columns = (
            TextColumn("[bold]{task.fields[name]}"),
            BarColumn(),
            # Piped output is 80 columns: the bar and the metrics give way, never the counts
            # or the elapsed time (which rich would otherwise cut to "0:0…").
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=3)),
            TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
            TextColumn(
                "{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")
            ),
        )
        try:
            with (
                processes.signals_raise(),
                (self.run_dir / LAUNCH_LOG).open("a" if self.resume else "w") as log,
                Progress(*columns, console=console) as progress,
            ):
                task = progress.add_task(
                    "starting ranks...", total=self.recipe.training.max_steps, name=self.recipe.name
                )
                proc = subprocess.Popen(
                    self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                    start_new_session=True,  # a terminal's Ctrl-C comes here; we stop the job
                )  # fmt: skip
                self.watch = JobWatch(proc.pid)
                next_look = time.monotonic() + WATCH_EVERY_S
                while True:
                    done = proc.poll() is not None
                    if not done and time.monotonic() >= next_look:
                        next_look = time.monotonic() + WATCH_EVERY_S
                        lines, self.gave_up = self.watch.look()
                        for line in lines:
                            _say(progress.console, line)
                        if self.gave_up:
                            processes.stop_descendants(grace_s=5.0)
                            proc.wait()
                            break
                    rows, offset = _read_new_lines(metrics_path, offset)
                    for row in rows:  # alerts rank 0 recorded with the step (moe/alerts.py)
                        for line in self._alert_console().lines(row):
                            _say(progress.console, line)
                    if rows:
                        self.last = rows[-1]
                        progress.update(
                            task,
                            completed=self.last["step"] + 1,
                            description=describe_step(self.last, self.recipe.algorithm),
                        )
                    if done:
                        break
                    time.sleep(poll_s)
        except (processes.Interrupted, KeyboardInterrupt) as stop:
            signum = stop.signum if isinstance(stop, processes.Interrupted) else signal.SIGINT
            with processes.signals_counted() as again:  # a second Ctrl-C: SIGKILL at once
                self.stopped = processes.stop_descendants(grace_s=10.0, force=again)
            return processes.Interrupted(signum).exit_status
        self.returncode = proc.returncode
        _stop_stragglers(ok=proc.returncode == 0)
        return None

    def interrupted_line(self, status: int, again: str) -> str:
        """The one line a stopped run prints."""
        from nemo_moe_metrics.sinks import read_resume_state

        name = next((s.name for s, code in processes.SIGNAL_EXIT.items() if code == status), "")
        last = read_resume_state(self.run_dir).last_step
        kept = "no step was logged yet" if last is None else f"it keeps every step up to {last}"
        return (
            f"interrupted ({name or f'exit {status}'}): stopped the training job "
            f"({self.stopped} process(es): launcher, torchrun, ranks); "
            f"{self.run_dir}: {kept}; continue it with: {again}"
        )

    def finish(self, console: Any) -> int:
        """Print the failure, or the summary of a run that succeeded; the exit status."""
        assert self.returncode is not None
        if self.gave_up:
            _say(console, f"run failed: {self.gave_up}; continue it with --resume")
            return 1
        if self.returncode != 0:
            words = Path(self.last_words) if self.last_words else None
            stopped = self.watch.failure_lines() if self.watch else []
            report = failure_report(self.run_dir, self.returncode, self.started, words, stopped)
            _say(console, report)
            return self.returncode
        held = self._alert_console().closing_line(f"nemo-moe-metrics report {self.run_dir}")
        if held:
            _say(console, held)
        last = (self.last or {}).get("step")
        console.print(f"[green]done[/green]: {self.run_dir}  (last step {last})", soft_wrap=True)
        if (self.run_dir / "metrics.jsonl").is_file():
            from nemo_moe_metrics.report import ReportError, render_report

            # The pictures and the summary a user looks at first (without the 'report' extra
            # the summary alone, with a line naming the extra).
            try:
                _say(console, render_report(self.run_dir))
            except ReportError as err:  # the training itself succeeded: say why, exit 0
                _say(console, f"report skipped: {err}")
        return 0


def _stop_stragglers(ok: bool) -> None:
    """Processes of the job still running after the launch process ended (torchrun or a rank
    left behind when it crashed; W&B's service finishing): given time after a success, then
    stopped."""
    deadline = time.monotonic() + (30.0 if ok else 2.0)
    while processes.descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    processes.stop_descendants(grace_s=5.0)


def failure_report(
    run_dir: Path,
    returncode: int,
    since: float = 0.0,
    last_words: Path | None = None,
    stopped: list[str] | None = None,
) -> str:
    """What a failed run prints: the failing rank's first error, then where the logs are.

    The rank that failed first is named (:mod:`.failures`): a rank killed by a signal (out of
    memory, ``kill -9``) as such, and the errors it caused on the other ranks ("Connection
    closed by peer") after it, as consequences. ``last_words`` is the file the ranks recorded
    their errors in (outside the run directory: it survives a full disk).
    """
    lines = [f"run failed (exit {returncode})", *(stopped or [])]
    log = _latest_rank_log(run_dir, since)
    launch_log = run_dir / LAUNCH_LOG
    full = _disk_full_note(run_dir)
    said = rank_failure_lines(log, read_failures(last_words))
    orphaned = launcher_death_lines(torchelastic_last_words(run_dir / NEMORUN_DIR, since))
    if orphaned and (not said or said[0].startswith("no Python exception")):
        lines += orphaned
    elif said and not said[0].startswith("no Python exception"):
        lines += said
    elif full:
        lines.append(full)  # the ranks' own errors may be what could not be written
        full = None
    elif log:
        lines += said + [f"  {line}" for line in _tail(log, 10)]
    elif launch_log.is_file():
        # The launcher itself failed (no rank started): its last lines say why.
        lines += [f"  {line}" for line in _tail(launch_log, 10)]
    if full:
        lines.append(full)
    if log:
        lines.append(f"rank log: {log}")
        hint = _status_hint(run_dir, log)
        if hint:
            lines.append(f"job status: {hint}")
    lines.append(f"launcher log: {launch_log}")
    return "\n".join(lines)


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError as err:
        return [f"(cannot read {path}: {err.strerror or err})"]


def _disk_full_note(run_dir: Path, below: int = 1 << 20) -> str | None:
    """A line when the run directory's file system is (nearly) full: then the ranks' own
    error may be missing from their log, which could not be written either."""
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= below:
        return None
    return (
        f"the run directory's file system is full ({free:,} bytes free at {run_dir}): writes "
        "failed there (logs may be cut short). Free space or choose another --output-dir, "
        "then continue with --resume"
    )


if __name__ == "__main__":
    sys.exit(main())
