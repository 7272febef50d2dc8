"""Submitting a recipe to Slurm through nemo-run: the executor (torchrun or one Slurm task per
rank), the readable dry run, and the submission that records the job for
:func:`~.slurm_job.follow_job`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import ConfigError, load_recipe
from nemo_moe_metrics.config.preflight import preflight, slurm_rank_words
from nemo_moe_metrics.launch.checks import check_resume_has_steps_left, claim_run_dir
from nemo_moe_metrics.launch.local import train_script, use_nemorun_home
from nemo_moe_metrics.launch.slurm_job import SlurmError, SubmittedJob

LAUNCHERS = ("torchrun", "srun")


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
    (:func:`nemo_moe_metrics.launch.slurm_job.rank_env_from_slurm`) and meets the others at
    ``MASTER_ADDR`` (the first node) and ``MASTER_PORT`` (``rdzv_port``).
    ``gpus_per_node=0``: CPU nodes with gloo, ``ranks_per_node`` ranks each, one thread per rank.
    Without a container image the job uses the submitting environment (sbatch exports it) with
    this interpreter's ``bin/`` first on ``PATH``. Submit from a login node (``LocalTunnel``,
    nemo-run's files under ``job_dir``); wrap in ``run.SSHTunnel`` to submit remotely.
    """
    import nemo_run as run

    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    per_node = ranks_on_each_node(
        {"ranks_per_node": ranks_per_node, "gpus_per_node": gpus_per_node}
    )
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
    Returns a :class:`nemo_moe_metrics.launch.slurm_job.SubmittedJob`, also saved under
    ``job_dir/submitted/`` for :func:`nemo_moe_metrics.launch.slurm_job.follow_job`.
    """

    recipe = load_recipe(recipe_path, overrides)
    nodes = executor_kwargs.get("nodes", 1)
    per_node = ranks_on_each_node(executor_kwargs)
    preflight(recipe, nodes * per_node, slurm_rank_words(nodes, per_node, _cpu(executor_kwargs)))
    recipe_for_job(recipe_path, check_committed=True)
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


def ranks_on_each_node(executor_kwargs: dict[str, Any]) -> int:
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


def recipe_for_job(recipe_path: str | Path, check_committed: bool = False) -> str:
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


def check_paths_survive_nemo_run(*paths: Path) -> None:
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

    recipe = load_recipe(recipe_path, overrides)
    nodes, per_node = executor_kwargs.get("nodes", 1), ranks_on_each_node(executor_kwargs)
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
        check_paths_survive_nemo_run(job_dir, output_root)
    use_nemorun_home(nemorun_home or job_dir)
    if not dryrun:
        # nemo-run's job-id index is a path taken from NEMORUN_HOME when the module is imported.
        scheduler = importlib.import_module("nemo_run.run.torchx_backend.schedulers.slurm")
        scheduler.SLURM_JOB_DIRS = str(job_dir / ".slurm_jobs")
    executor = slurm_executor(job_dir=job_dir, **kwargs)
    # The Slurm job is named after the recipe (nemo-run's default is "<account>-<account>.").
    executor.job_details.job_name = name
    script = train_script(recipe_for_job(recipe_path), overrides, output_root / name)
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
