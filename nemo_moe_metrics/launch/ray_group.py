"""The policy as a worker group of Ray actors, one per rank, driven by one process.

:class:`RayWorkerGroup` starts one :class:`~.ray_actor.MegatronPolicyActor` per bundle of a
placement group (:mod:`.ray_cluster`), makes them one torch.distributed process group (rank
0's node and a port free there), and offers the loops the interface of a rank group
(:mod:`nemo_moe_metrics.algorithms.ranks`): every call goes to every actor at once, each with
its own data-parallel rank's batch, and the driver waits for all of them. A training step's
results are merged (:func:`~nemo_moe_metrics.worker.results.merge_worker_results`), never
reduced again.

Every wait is bounded (``ray.start_timeout_s``, ``ray.step_timeout_s``). The first rank that
fails ends the call with :class:`WorkerGroupError` naming the rank, its node and its last
error: a Python exception with where it was raised, or how the actor died (``kill -9``, the
out-of-memory killer, ``ray.kill``, a lost node). An error that only follows from another
rank's failure (a peer that closed the connection) is not taken for the cause.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.launch.failures import RankFailure, frame_summary
from nemo_moe_metrics.launch.ray_actor import MegatronPolicyActor
from nemo_moe_metrics.launch.ray_cluster import Placement
from nemo_moe_metrics.worker.results import merge_worker_results

_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (.+)$', re.M)
# How a rank fails when another one failed first: it lost its peer in a collective.
_CONSEQUENCE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out")
# Seconds to wait, after a first failure, for the others (the cause may arrive second).
_SETTLE_S = 2.0


class WorkerGroupError(RuntimeError):
    """A rank of the worker group failed: ``rank``, ``where`` it ran, ``kind`` (``raised``,
    ``died``, ``failed``) and ``text`` (the exception, or how the actor died)."""

    def __init__(
        self,
        rank: int,
        where: Mapping[str, Any],
        kind: str,
        text: str,
        *,
        frame: str | None = None,
        raised_at: str | None = None,
    ) -> None:
        self.rank, self.where, self.kind, self.text = rank, dict(where), kind, text
        self.frame, self.raised_at = frame, raised_at
        sep = " " if kind == "raised" else ": "
        super().__init__(f"rank {rank} ({self.place}) {kind}{sep}{text}")

    @property
    def died(self) -> bool:
        """The actor's process ended (no exception of its own)."""
        return self.kind == "died"

    @property
    def place(self) -> str:
        """``actor pid P on node IP, node id ID``: where the rank ran."""
        return place_text(self.where)

    def recorded(self) -> RankFailure:
        """This failure as ``run`` reports a rank's
        (:func:`~nemo_moe_metrics.launch.failures.record_rank_failure`): what happened, and
        where."""
        if self.kind == "raised":
            text = f"{self.text} ({self.place})"
        else:
            text = f"{self.kind} ({self.place}): {self.text}"
        return RankFailure(self.rank, text, self.frame, self.raised_at, died=self.kind != "raised")


def place_text(where: Mapping[str, Any]) -> str:
    """``actor pid P on node HOST IP, node id ID``: where a rank ran (``where``: its actor's)."""
    node = where.get("node_ip") or "?"
    if where.get("host") and where.get("host") != node:
        node = f"{where['host']} {node}"
    node_id = str(where.get("node_id") or "?")[:12]
    return f"actor pid {where.get('pid', '?')} on node {node}, node id {node_id}"


def describe_ray_error(err: BaseException) -> tuple[str, str, str | None, str | None]:
    """``(kind, text, frame, raised_at)`` of a Ray error from one actor's call: ``raised`` with
    the actor's exception and where, ``died`` with how its process ended, else ``failed``."""
    import ray.exceptions as rex

    text = str(err)
    if isinstance(err, rex.RayTaskError):
        cause = getattr(err, "cause", None)
        summary = f"{type(cause).__name__}: {cause}" if cause is not None else text.splitlines()[-1]
        frames = [(m[1], int(m[2]), m[3]) for m in _FRAME.finditer(text)]
        frame, raised_at = frame_summary(frames)
        return "raised", summary, frame, raised_at
    if isinstance(err, rex.RayActorError):
        why = re.search(r"The actor is dead because (.*?)(?: Some common causes|\Z)", text, re.S)
        said = " ".join((why[1] if why else text.splitlines()[0]).split())
        if "worker process has died" in said or "unexpectedly exits" in said:
            said = (
                "its process ended without a Python error (killed by a signal such as kill -9 "
                f"or the out-of-memory killer, or a crash); Ray: {said}"
            )
        return "died", said, None, None
    return "failed", f"{type(err).__name__}: {text.splitlines()[0] if text else ''}", None, None


class RayWorkerGroup:
    """One :class:`~.ray_actor.MegatronPolicyActor` per rank, in one process group.

    ``recipe``: the validated recipe (sent to every actor); ``placement``: where each rank
    runs; ``totals``: ``(tokens, seconds, flops)`` to resume the ``train_perf/`` totals from;
    ``start_step``: the step the next :meth:`train` is; ``env``: environment variables of the
    actors' processes (``PYTHONPATH``, ``OMP_NUM_THREADS``, ...).
    """

    def __init__(
        self,
        recipe: Any,
        placement: Placement,
        *,
        totals: tuple[float, float, float] | None = None,
        start_step: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start the actors, join their process group and build every rank's worker; on any
        failure the actors started are killed before the error is raised."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.recipe = recipe
        self.placement = placement
        self.world_size = placement.plan.world_size
        self.step = start_step
        self.start_timeout_s = recipe.ray.start_timeout_s
        self.step_timeout_s = recipe.ray.step_timeout_s
        #: Wall seconds of the driver's calls since the last :meth:`take_timings`, by method.
        self.timings: dict[str, float] = {}
        actor_cls = ray.remote(MegatronPolicyActor)
        use_gpu = placement.plan.use_gpu
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = [{} for _ in range(self.world_size)]
        try:
            for bundle in placement.bundles:
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=placement.group, placement_group_bundle_index=bundle
                )
                self.actors.append(
                    actor_cls.options(
                        num_cpus=1,
                        num_gpus=1 if use_gpu else 0,
                        scheduling_strategy=strategy,
                        runtime_env={"env_vars": dict(env or {})},
                        max_restarts=0,
                        max_task_retries=0,
                    ).remote()
                )
            self.where = self._gather("where", [() for _ in self.actors], self.start_timeout_s)
            port = self._gather("free_port", [()], self.start_timeout_s, ranks=[0])[0]
            data = recipe.model_dump(mode="json")
            addr = self.where[0]["node_ip"]
            args = [(data, r, self.world_size, addr, port, totals) for r in range(self.world_size)]
            infos = self._gather("setup", args, self.start_timeout_s)
        except BaseException:
            self.kill()
            raise
        self.dp_of = [int(info["dp_rank"]) for info in infos]
        self._dp_size = int(infos[0]["dp_size"])

    # ----------------------------------------------------------- the rank-group interface
    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the group."""
        return self._dp_size

    @property
    def dp_ranks(self) -> list[int]:
        """Every data-parallel rank: the driver builds every rank's batch."""
        return sorted(set(self.dp_of))

    def _per_rank(self, values: Mapping[int, Any]) -> list[Any]:
        return [values[d] for d in self.dp_of]

    def _by_dp(self, results: list[Any]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for d, value in zip(self.dp_of, results, strict=True):
            out.setdefault(d, value)  # ranks of one data-parallel rank computed the same
        return out

    def generate(
        self,
        prompts: Mapping[int, Any],
        max_new_tokens: int,
        temperature: float,
        generators: Mapping[int, Any],
        precision: str = "fp32",
    ) -> dict[int, Any]:
        """Every rank samples its data-parallel rank's prompts with that rank's generator."""
        args = [
            (prompts[d], max_new_tokens, temperature, generators[d].get_state(), precision)
            for d in self.dp_of
        ]
        return self._by_dp(self._timed("generate", args))

    def logprobs(self, batches: Mapping[int, Any]) -> dict[int, Any]:
        """Every rank's next-token log-probabilities (no grad)."""
        return self._by_dp(self._timed("logprobs", [(b,) for b in self._per_rank(batches)]))

    def snapshot_reference(self) -> None:
        """Every rank keeps its current weights as the reference policy."""
        self._timed("snapshot_reference", [() for _ in self.actors])

    def reference_logprobs(self, batches: Mapping[int, Any]) -> dict[int, Any]:
        """Every rank's log-probabilities under its reference weights."""
        args = [(b,) for b in self._per_rank(batches)]
        return self._by_dp(self._timed("reference_logprobs", args))

    def rollout_routes(self, batches: Mapping[int, Any], precision: str) -> dict[int, Any]:
        """Every rank's rollout routes."""
        args = [(b, precision) for b in self._per_rank(batches)]
        return self._by_dp(self._timed("rollout_routes", args))

    def train(self, batches: Mapping[int, Any], loss_fn: Any) -> dict[str, Any]:
        """One optimizer step on every rank; the step's metrics merged from their results."""
        args = [(b, loss_fn, self.step) for b in self._per_rank(batches)]
        results = self._timed("train", args)
        self.step += 1
        return merge_worker_results(results)

    def mean_over_dp(self, values: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """The mean over the data-parallel ranks, computed here (the driver holds them all)."""
        keys = sorted(next(iter(values.values())))
        n = len(values)
        return {k: sum(float(v[k]) for v in values.values()) / n for k in keys}

    # ----------------------------------------------------------------------- plumbing
    def take_timings(self) -> dict[str, float]:
        """The wall seconds of each kind of call since the last time, and start afresh."""
        out, self.timings = self.timings, {}
        return out

    def _timed(self, method: str, args: list[tuple]) -> list[Any]:
        start = time.perf_counter()
        try:
            return self._gather(method, args, self.step_timeout_s)
        finally:
            spent = time.perf_counter() - start
            self.timings[method] = self.timings.get(method, 0.0) + spent

    def _gather(
        self, method: str, args: list[tuple], timeout_s: float, ranks: list[int] | None = None
    ) -> list[Any]:
        """Call ``method`` on the ranks (default: all) with their arguments; their results in
        rank order, or :class:`WorkerGroupError` for the first rank that failed."""
        import ray

        ranks = list(range(len(self.actors))) if ranks is None else ranks
        refs = [
            getattr(self.actors[r], method).remote(*a) for r, a in zip(ranks, args, strict=True)
        ]
        rank_of = {ref: r for ref, r in zip(refs, ranks, strict=True)}
        results: dict[int, Any] = {}
        errors: list[tuple[int, BaseException]] = []
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        settle: float | None = None
        while pending:
            left = deadline - time.monotonic()
            if settle is not None:
                left = min(left, settle - time.monotonic())
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(1.0, left))
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    errors.append((rank_of[ref], err))
                    settle = settle or time.monotonic() + _SETTLE_S
        if errors:
            raise self._first_failure(errors, method)
        if pending:
            late = sorted(rank_of[ref] for ref in pending)
            where = "; ".join(f"rank {r}: {place_text(self.where[r])}" for r in late)
            raise WorkerGroupError(
                late[0],
                self.where[late[0]],
                "timed out",
                f"{method} did not finish within {timeout_s:g} s (ranks still busy: {where}); "
                "raise ray.step_timeout_s (ray.start_timeout_s while starting) if it is slow",
            )
        return [results[r] for r in ranks]

    def _first_failure(
        self, errors: list[tuple[int, BaseException]], method: str
    ) -> WorkerGroupError:
        described = []
        for rank, err in errors:
            kind, text, frame, raised_at = describe_ray_error(err)
            consequence = kind != "died" and any(c in text for c in _CONSEQUENCE)
            described.append((consequence, kind != "died", rank, kind, text, frame, raised_at))
        # A death first, then a real error, then a lost peer; lower ranks first among equals.
        _, _, rank, kind, text, frame, raised_at = min(described)
        where = self.where[rank] if rank < len(self.where) else {}
        return WorkerGroupError(
            rank, where, kind, f"{text} (in {method})", frame=frame, raised_at=raised_at
        )

    def ranks_table(self) -> list[dict[str, Any]]:
        """Where every rank ran (``run.json``): rank, data-parallel rank, pid, host, node."""
        return [
            {"rank": r, "dp_rank": self.dp_of[r], "bundle": self.placement.bundles[r], **w}
            for r, w in enumerate(self.where)
        ]

    def close(self) -> None:
        """Leave the process group on every rank (after the last step), then stop the actors."""
        try:
            self._gather("close", [() for _ in self.actors], self.start_timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop every actor now (no more calls are answered) and give the bundles back."""
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone, or Ray is shutting down
                ray.kill(actor, no_restart=True)
        self.actors = []
        self.placement.remove()


__all__ = ["RayWorkerGroup", "WorkerGroupError", "describe_ray_error", "place_text"]
