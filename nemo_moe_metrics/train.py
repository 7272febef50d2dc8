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

from nemo_moe_metrics.algorithms import run_algorithm
from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
from nemo_moe_metrics.config import ConfigError, Recipe, load_recipe
from nemo_moe_metrics.config.preflight import preflight
from nemo_moe_metrics.launch.failures import record_failure, record_refusal
from nemo_moe_metrics.launch.recipe_run import (
    make_metrics,
    open_recipe_run,
    own_run_dir,
    requeued_run_resumes,
)
from nemo_moe_metrics.launch.slurm_job import SlurmError, rank_env_from_slurm
from nemo_moe_metrics.launch.train_args import rank_argv
from nemo_moe_metrics.run_dir.lock import RunDirLock
from nemo_moe_metrics.run_dir.resume import ResumeState, prepare_resume
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics


def train(recipe: Recipe, output_dir: str | Path) -> None:
    """Build the worker, run the recipe's loop, write the run directory on rank 0.

    With ``logger.resume`` the run in ``output_dir`` continues from its last logged step
    (see :mod:`nemo_moe_metrics.run_dir.resume`): the loop starts at the next step, the
    ``train_perf/`` totals go on, and every sink appends to the same run.
    """
    import torch.distributed as dist

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
