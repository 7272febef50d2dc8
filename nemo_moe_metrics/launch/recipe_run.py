"""A recipe's run, opened by the process that logs it: rank 0 of a torchrun job
(``python -m nemo_moe_metrics.train``) or the driver of ``run --engine ray``.

The metrics integration the recipe's flags ask for (:func:`make_metrics`), rank 0's hold on the
run directory (:func:`own_run_dir`: it joins its launcher's lock or takes it), one run per
directory said in recipe terms (:func:`refuse_a_logged_run`), a Slurm requeue continuing its own
run (:func:`requeued_run_resumes`) and the run's records opened (:func:`open_recipe_run`).
"""

from __future__ import annotations

import os
from pathlib import Path

from nemo_moe_metrics.adapters.family import ModelFacts
from nemo_moe_metrics.config import Recipe, dump_recipe
from nemo_moe_metrics.launch.slurm_job import requeue_count
from nemo_moe_metrics.run_dir.lock import TOKEN_ENV, RunDirLock
from nemo_moe_metrics.run_dir.names import RECIPE_FILE
from nemo_moe_metrics.run_dir.record import logged_run, refuse_logged_run
from nemo_moe_metrics.run_dir.resume import ResumeState
from nemo_moe_metrics.run_dir.session import RunSession, build_sinks
from nemo_moe_metrics.runtime.durable import write_text_durably
from nemo_moe_metrics.sinks.base import NullSink
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics


def make_metrics(recipe: Recipe) -> PolicyMetrics | None:
    """The metrics integration the flags ask for; None when every metric flag is off."""
    cfg = recipe.policy.megatron_cfg.metrics()
    if not (cfg.track_moe_metrics or cfg.track_throughput):
        return None
    return PolicyMetrics(cfg, vocab_size=recipe.policy.model.vocab_size)


def open_recipe_run(
    recipe: Recipe,
    output_dir: Path,
    state: ResumeState | None,
    rank: int = 0,
    *,
    facts: ModelFacts | None = None,
    lock: RunDirLock | None = None,
) -> RunSession | NullSink:
    """This run's records in ``output_dir``, opened by the process that logs (rank 0 under
    torchrun, the driver under Ray): one run per directory, ``recipe.yaml``, the resume note,
    then the sinks through :func:`~nemo_moe_metrics.run_dir.session.open_run` (``run.json``
    among them); a ``NullSink`` on other ranks. ``lock``: the directory's lock the caller holds
    (:func:`own_run_dir`)."""
    if rank == 0:
        refuse_a_logged_run(output_dir, recipe)  # before recipe.yaml: the old run stays whole
        output_dir.mkdir(parents=True, exist_ok=True)
        write_text_durably(output_dir / RECIPE_FILE, dump_recipe(recipe))
        if state is not None and state.last_step is not None:
            left = max(0, recipe.training.max_steps - state.next_step)
            print(
                f"resuming {output_dir} after step {state.last_step}: {left} step(s) left of "
                f"training.max_steps={recipe.training.max_steps}",
                flush=True,
            )
    return build_sinks(
        recipe.logger,
        output_dir,
        run_name=recipe.name,
        config=recipe.model_dump(mode="json"),
        rank=rank,
        resume_state=state,
        facts=facts,
        lock=lock,
    )


def refuse_a_logged_run(output_dir: Path, recipe: Recipe) -> None:
    """One run per directory (run_dir/record.py, as ``run`` and ``build_sinks``), said in
    recipe terms."""
    refuse_logged_run(
        output_dir,
        resume=recipe.logger.resume,
        ways="pass the override logger.resume=true to continue it, or choose another "
        "--output-dir (nemo-moe-metrics run --overwrite deletes the old run first)",
    )


def own_run_dir(output_dir: Path) -> RunDirLock:
    """Rank 0's hold on the run directory: it joins the lock of the launcher that started the
    job (``nemo-moe-metrics run`` passes its token), or takes it itself (a job started
    another way, e.g. by Slurm); :class:`~nemo_moe_metrics.run_dir.RunDirBusyError` when
    another run holds the directory."""
    token = os.environ.get(TOKEN_ENV)
    lock = RunDirLock(output_dir)
    if token:
        return lock.join(token)
    lock.acquire(writer=True)
    lock.mark_run()  # a run starts here: its directory is a run's from now on
    for note in lock.notes:
        print(note, flush=True)
    return lock


def requeued_run_resumes(output_dir: Path) -> list[str]:
    """``["logger.resume=true"]`` when Slurm requeued this job and its first start logged steps.

    nemo-run submits with ``sbatch --requeue``: after a node failure or a preemption Slurm
    starts the same job again (``SLURM_RESTART_COUNT`` > 0), with the same command, into the
    run directory its earlier start wrote. That run is this job's own, so it continues.
    """
    restarts = requeue_count(os.environ)
    if not restarts or not logged_run(output_dir):
        return []
    if os.environ.get("RANK", "0") == "0":
        print(
            f"Slurm requeued job {os.environ.get('SLURM_JOB_ID', '?')} (restart {restarts}): "
            f"continuing its run in {output_dir}",
            flush=True,
        )
    return ["logger.resume=true"]
