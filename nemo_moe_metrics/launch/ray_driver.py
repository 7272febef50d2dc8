"""The Ray engine's driver: one process runs the loop, a worker group of Ray actors trains.

``python -m nemo_moe_metrics.launch.ray_driver RECIPE [k=v ...] --nproc N --output-dir D
[--ray-address ADDR]`` (what ``nemo-moe-metrics run --engine ray`` starts, and what a Slurm job
runs on its first node after starting Ray there): the driver

1. joins the Ray cluster at ``--ray-address`` / ``RAY_ADDRESS`` or starts an embedded local Ray
   (:mod:`.ray_cluster`), and refuses a cluster that cannot hold the ranks before any actor
   starts;
2. owns the run directory (its lock, the resume state, ``recipe.yaml``, the sinks: the same
   functions a torchrun job's rank 0 uses, :mod:`nemo_moe_metrics.launch.recipe_run`);
3. starts the worker group (:mod:`.ray_group`), records each rank's node in ``run.json``
   (``ray.ranks``), and runs the recipe's loop over it, adding its own ``driver/`` keys;
4. on a failed rank, names it (rank, node, last error) and stops every actor; on Ctrl-C,
   SIGTERM or SIGHUP, stops every actor and, for an embedded Ray, the Ray processes it started.
   Every step logged before stays; ``--resume`` (``logger.resume=true``) continues after it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nemo_moe_metrics.algorithms import run_algorithm
from nemo_moe_metrics.config import ConfigError, Recipe, load_recipe
from nemo_moe_metrics.config.preflight import preflight
from nemo_moe_metrics.export import metric_names as names
from nemo_moe_metrics.launch.failures import record_failure, record_rank_failure
from nemo_moe_metrics.launch.ray_cluster import (
    ADDRESS_ENV,
    RaySession,
    check_embedded,
    connect,
    import_ray,
    place,
    plan_placement,
)
from nemo_moe_metrics.launch.ray_group import RayWorkerGroup, WorkerGroupError
from nemo_moe_metrics.launch.recipe_run import open_recipe_run, own_run_dir, requeued_run_resumes
from nemo_moe_metrics.launch.supervise import SRC_ROOT
from nemo_moe_metrics.run_dir.lock import RunDirError
from nemo_moe_metrics.run_dir.resume import prepare_resume
from nemo_moe_metrics.run_dir.run_json import read_run_json
from nemo_moe_metrics.run_dir.session import RunSession
from nemo_moe_metrics.runtime import processes
from nemo_moe_metrics.runtime.extras import MissingExtraError


def actor_env() -> dict[str, str]:
    """The actors' environment: this source tree importable, one intra-op thread per rank (as
    torchrun's ranks here), W&B offline unless said otherwise."""
    path = os.pathsep.join(p for p in (SRC_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
    }


def drive(
    recipe: Recipe,
    nproc: int,
    output_dir: str | Path,
    *,
    address: str | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """Train ``recipe`` on ``nproc`` Ray actors from this process; the run directory.

    Raises :class:`~.ray_cluster.RayClusterError` (a ConfigError) before any actor starts when
    the cluster cannot hold the ranks, :class:`~.ray_group.WorkerGroupError` when a rank fails;
    every actor (and an embedded Ray) is stopped before this returns or raises.
    """
    run_dir = Path(output_dir).resolve() / recipe.name
    import_ray()  # the extra, named, before anything starts
    if not (address or os.environ.get(ADDRESS_ENV)):
        check_embedded(nproc)  # refused before an embedded Ray starts
    session = connect(address)
    try:
        # ray.init put its own SIGTERM handler (a crash report, then abort) in place of ours.
        with stopping_signals_raise():
            plan = plan_placement(nproc, session.address)  # refused here, before any actor
            _drive(recipe, plan, run_dir, session, say)
    finally:
        session.shutdown()
    return run_dir


@contextlib.contextmanager
def stopping_signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`~nemo_moe_metrics.runtime.processes.Interrupted` in
    the block, over whatever handler Ray installed (restored afterwards when Python can)."""

    def handler(signum: int, frame: object) -> None:
        raise processes.Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in processes.SIGNAL_EXIT}
    try:
        yield
    finally:
        for sig, previous in old.items():
            # None: a handler Python did not install (Ray's); the default ends the process.
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def _open_run_dir(recipe: Recipe, run_dir: Path, say: Callable[[str], None]) -> tuple:
    """The run directory, opened as a torchrun job's rank 0 opens it (the lock, the resume,
    then :func:`~nemo_moe_metrics.launch.recipe_run.open_recipe_run`):
    ``(lock, resume state or None, sink, earlier starts' ranks)``."""
    lock = own_run_dir(run_dir)
    try:
        state = None
        if recipe.logger.resume:
            state, notes = prepare_resume(run_dir, table_every=recipe.logger.table_every)
            for note in notes:
                say(f"resume: {note}")
        earlier = _earlier_placements(run_dir) if state is not None else []
        # rewrites run.json: its ray section was read before
        sink = open_recipe_run(recipe, run_dir, state, lock=lock)
    except BaseException:
        lock.release()
        raise
    return lock, state, sink, earlier


def _drive(recipe: Recipe, plan: Any, run_dir: Path, session: RaySession, say) -> None:
    lock, state, sink, earlier = _open_run_dir(recipe, run_dir, say)
    start_step = state.next_step if state is not None else 0
    totals = (state.total_tokens, state.total_seconds, state.total_flops) if state else None
    group = None
    try:
        placement = place(plan, recipe.ray.start_timeout_s)
        group = RayWorkerGroup(
            recipe, placement, totals=totals, start_step=start_step, env=actor_env()
        )
        record_placement(sink, group, session, earlier)
        say(
            f"driver: {plan.world_size} Ray actor(s) ({plan.strategy}, "
            f"{'GPU' if plan.use_gpu else 'CPU'}) on {len({w['node_id'] for w in group.where})} "
            f"node(s) of the {'embedded' if session.embedded else 'Ray'} cluster at "
            f"{session.address}"
        )
        run_algorithm(recipe, group, DriverLog(sink.log, group), start_step=start_step)
        group.close()
    finally:
        if group is not None:
            group.kill()
        sink.close()
        lock.release()


class DriverLog:
    """The loop's ``log_fn`` on the driver: the step's keys plus the ``driver/`` keys."""

    def __init__(self, log: Callable[[dict[str, Any], int], None], group: Any) -> None:
        """``log``: the sink's; ``group``: the worker group whose call timings are read."""
        self.log, self.group = log, group
        self.last = time.perf_counter()

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        """Add the driver's keys for this step and log it."""
        now = time.perf_counter()
        spent = self.group.take_timings()
        step_s = now - self.last
        own = {
            names.DRIVER_STEP_SECONDS: step_s,
            names.DRIVER_TRAIN_SECONDS: spent.get("train", 0.0),
            names.DRIVER_SCORE_SECONDS: sum(
                spent.get(k, 0.0) for k in ("logprobs", "reference_logprobs", "rollout_routes")
            ),
        }
        if "generate" in spent:
            own[names.DRIVER_GENERATE_SECONDS] = spent["generate"]
        tokens = metrics.get(names.TOKENS)
        if isinstance(tokens, int | float) and step_s > 0:
            own[names.DRIVER_TOKENS_PER_SECOND] = tokens / step_s
        clash = sorted(set(own) & set(metrics))
        if clash:
            raise ValueError(f"the loop already produced the driver's keys {clash}")
        self.log({**metrics, **own}, step)
        self.last = time.perf_counter()


def _earlier_placements(run_dir: Path) -> list[Any]:
    """The ranks tables of the starts a resumed run had before (``run.json``'s ``ray``)."""
    earlier = read_run_json(run_dir).get("ray")
    if not isinstance(earlier, dict):
        return []
    return [*earlier.get("earlier", []), *([earlier["ranks"]] if "ranks" in earlier else [])]


def record_placement(
    sink: RunSession, group: Any, session: RaySession, earlier: list[Any] | None = None
) -> None:
    """Add where every rank runs to ``run.json`` (``ray``): the cluster, the strategy, and per
    rank its node id and address, host, pid and GPUs; ``earlier``: the ranks of the starts a
    resumed run had before."""
    sink.record(
        engine="ray",
        ray={
            "address": session.address,
            "embedded": session.embedded,
            "strategy": group.placement.plan.strategy,
            "use_gpu": group.placement.plan.use_gpu,
            "nodes": len({w["node_id"] for w in group.where}),
            "ranks": group.ranks_table(),
            **({"earlier": earlier} if earlier else {}),
        },
    )


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the driver."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_moe_metrics.launch.ray_driver",
        description="Run a recipe's loop on this process over Ray actors (one per rank).",
    )
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--nproc", type=int, default=2, help="ranks: one Ray actor each")
    parser.add_argument("--output-dir", default="runs", help="runs go to DIR/<recipe name>/")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster (default: RAY_ADDRESS, else an embedded local Ray)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when every step trained, 1 when a rank failed, 2 for a refusal, 128 +
    the signal when stopped."""
    args = build_parser().parse_intermixed_args(argv)
    launcher = os.environ.get(processes.LAUNCHER_ENV)
    if launcher:  # started by `run`: end with it (SIGTERM, handled below like Ctrl-C)
        processes.die_with_parent(int(launcher.partition(":")[0]))
    try:
        run_root = Path(args.output_dir).resolve()
        overrides = list(args.overrides)
        recipe = load_recipe(args.recipe, overrides)
        overrides += requeued_run_resumes(run_root / recipe.name)  # a requeued Slurm job
        recipe = load_recipe(args.recipe, [*overrides, "engine=ray"])
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
        preflight(recipe, args.nproc)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with stopping_signals_raise():
            run_dir = drive(recipe, args.nproc, run_root, address=args.ray_address)
    except processes.Interrupted as stop:
        print(
            f"driver: {stop}: stopped every actor (and Ray, where it started it)", file=sys.stderr
        )
        return stop.exit_status
    except WorkerGroupError as err:
        record_rank_failure(err.recorded())
        print(f"error: {err}", file=sys.stderr)
        if err.frame:
            print(f"  at {err.frame}", file=sys.stderr)
        return 1
    except (ConfigError, MissingExtraError, RunDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BaseException as err:
        record_failure(err, rank=0)
        raise
    print(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
