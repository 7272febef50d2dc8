"""Per-rank training entrypoint: ``python -m nemo_moe_metrics.train --recipe R --output-dir D``.

torchrun (through nemo-run, see :mod:`nemo_moe_metrics.launch.local`) starts one of these per rank.
Every rank builds the policy worker (with the metrics integration the recipe's flags ask for)
and runs the recipe's loop; rank 0 writes the sinks the recipe enables (``D/metrics.jsonl``,
``D/tensorboard/``, ``D/wandb/``) and ``D/recipe.yaml``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from nemo_moe_metrics.adapters.family import ModelFacts
from nemo_moe_metrics.config import ConfigError, Recipe, dump_recipe, load_recipe
from nemo_moe_metrics.config.preflight import preflight
from nemo_moe_metrics.launch.failures import record_failure, record_refusal
from nemo_moe_metrics.launch.slurm_job import SlurmError, rank_env_from_slurm, requeue_count
from nemo_moe_metrics.launch.train_args import rank_argv
from nemo_moe_metrics.run_dir.lock import TOKEN_ENV, RunDirLock
from nemo_moe_metrics.run_dir.names import RECIPE_FILE
from nemo_moe_metrics.run_dir.record import logged_run, refuse_logged_run
from nemo_moe_metrics.run_dir.resume import ResumeState, prepare_resume
from nemo_moe_metrics.run_dir.session import RunSession, build_sinks
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.runtime.durable import write_text_durably
from nemo_moe_metrics.sinks.base import NullSink
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics


def make_metrics(recipe: Recipe) -> PolicyMetrics | None:
    """The metrics integration the flags ask for; None when every metric flag is off."""
    cfg = recipe.policy.megatron_cfg.metrics()
    if not (cfg.track_moe_metrics or cfg.track_throughput):
        return None
    return PolicyMetrics(cfg, vocab_size=recipe.policy.model.vocab_size)


def train(recipe: Recipe, output_dir: str | Path) -> None:
    """Build the worker, run the recipe's loop, write the run directory on rank 0.

    With ``logger.resume`` the run in ``output_dir`` continues from its last logged step
    (see :mod:`nemo_moe_metrics.run_dir.resume`): the loop starts at the next step, the
    ``train_perf/`` totals go on, and every sink appends to the same run.
    """
    import torch.distributed as dist

    from nemo_moe_metrics.megatron.policy import MegatronPolicyWorker

    output_dir = Path(output_dir)
    metrics = make_metrics(recipe)
    worker = MegatronPolicyWorker(recipe, metrics=metrics)
    rank = dist.get_rank()
    # Rank 0 writes the run directory: it owns it (or joins its launcher) before any write.
    lock = own_run_dir(output_dir) if rank == 0 else None
    try:
        _train(recipe, output_dir, worker, metrics, rank, lock)
    finally:
        if lock is not None:
            lock.release()


def _train(
    recipe: Recipe,
    output_dir: Path,
    worker: Any,
    metrics: PolicyMetrics | None,
    rank: int,
    lock: RunDirLock | None,
) -> None:
    import torch.distributed as dist

    from nemo_moe_metrics.algorithms import run_algorithm

    state = _resume_state(output_dir, rank, recipe) if recipe.logger.resume else None
    if state is not None and metrics is not None:
        metrics.resume_totals(state.total_tokens, state.total_seconds, state.total_flops)
    start_step = state.next_step if state is not None else 0
    sink = open_recipe_run(
        recipe,
        output_dir,
        state,
        rank,
        facts=metrics.facts if metrics is not None else None,
        lock=lock,  # rank 0 already owns the directory (own_run_dir)
    )
    try:
        run_algorithm(recipe, worker, sink.log, start_step=start_step)
    except BaseException:
        # No barrier: the other ranks are mid-step; a collective here would fail in turn and
        # its error would hide this one. Leaving ends them (torchrun, or their collectives).
        sink.close()
        raise
    sink.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
        _refuse_a_logged_run(output_dir, recipe)  # before recipe.yaml: the old run stays whole
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


def _refuse_a_logged_run(output_dir: Path, recipe: Recipe) -> None:
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


def _resume_state(output_dir: Path, rank: int, recipe: Recipe) -> ResumeState:
    """Rank 0 makes the run directory's records agree and reads where to continue (saying
    what it cut, see :func:`~nemo_moe_metrics.sinks.prepare_resume`); every rank gets the same
    state (one broadcast)."""
    import torch.distributed as dist

    state = None
    if rank == 0:
        state, notes = prepare_resume(output_dir, table_every=recipe.logger.table_every)
        for note in notes:
            print(f"resume: {note}", flush=True)
    box = [state]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


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


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the per-rank entrypoint."""
    parser = argparse.ArgumentParser(prog="python -m nemo_moe_metrics.train")
    parser.add_argument("--recipe", required=True, help="YAML recipe")
    parser.add_argument("--output-dir", required=True, help="run directory (rank 0 writes here)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; a configuration error prints one line and exits with status 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = rank_argv(argv)  # a local launch passes them in the environment (train_args.py)
        args = build_parser().parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        record_refusal(str(err), argv)
        return 2
    except SystemExit as stop:  # argparse said why on stderr; the launcher says which rank
        if stop.code:
            record_refusal("its command line does not parse (see its log)", argv)
        raise
    try:
        # One Slurm task per rank (srun without torchrun): the rank comes from Slurm.
        os.environ.update(rank_env_from_slurm(os.environ))
        overrides = [*args.overrides, *requeued_run_resumes(Path(args.output_dir))]
        recipe = load_recipe(args.recipe, overrides)
        # Launched by torchrun (locally or on Slurm): the same checks `check` and `run` make.
        world = os.environ.get("WORLD_SIZE")
        preflight(recipe, int(world) if world else None)
    except (ConfigError, SlurmError) as err:
        print(f"error: {err}", file=sys.stderr)
        record_refusal(str(err), argv)
        return 2
    if "LOCAL_RANK" in os.environ:  # started by torchrun: end with it (and with `run`)
        rank = os.environ.get("RANK", os.environ["LOCAL_RANK"])
        processes.watch_launcher(os.environ.get(processes.LAUNCHER_ENV), label=f"rank {rank}")
    # Two CPU ranks on two cores: more intra-op threads per rank only oversubscribe.
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        train(recipe, args.output_dir)
    except BaseException as err:
        record_failure(err)  # survives a full run directory (see failures.py)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
