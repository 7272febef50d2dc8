"""What a policy worker returns from one step, and the driver's merge of every worker's result.

Single-controller frameworks (NeMo RL, verl, AReaL, OpenRLHF, and ``nemo-moe-metrics run
--engine ray``) run the loop on a driver and the policy as a group of workers (Ray actors) that
form one torch.distributed group. Each worker calls ``PolicyMetrics.finish_step`` (a
collective: the metrics are reduced inside the workers' process group, and every rank gets the
same dict) and returns a :class:`WorkerResult`; the driver merges the results
(:func:`merge_worker_results`): it checks they belong together and takes the lowest rank's
keys, as they are. It never reduces again: the numbers are the ones an SPMD run's rank 0 logs.

The ``moe/expert_loads`` value is an :class:`~nemo_moe_metrics.export.expert_table.ExpertTable`: it
is pickled as its three arrays (never as rows), so it crosses Ray's object store at array size.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class StepSink(Protocol):
    """Where merged keys go: ``build_sinks(...)``'s sink, or anything with this ``log``."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's keys."""


@dataclass(frozen=True)
class WorkerResult:
    """One worker's answer to one training step (what its remote ``train`` call returns).

    ``metrics``: the step's keys as the worker produced them (``PolicyMetrics.finish_step``'s
    ``moe/`` and ``train_perf/`` keys, and the worker's own ``train/`` keys), already reduced
    over the workers' process group; empty on the ranks that only vouch for them (every rank
    but 0 by default: the dict is the same on every rank, so one copy crosses to the driver).
    ``keys``: a digest of the step's key names, on every rank, to check they belong together.
    ``node``: where the rank ran (a Ray node id or a host), named when something goes wrong.
    """

    rank: int
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    node: str | None = None
    keys: str = ""


def key_digest(metrics: Mapping[str, Any]) -> str:
    """A short digest of a step dict's key names (equal dicts of keys, equal digests)."""
    return hashlib.blake2b("\n".join(sorted(metrics)).encode(), digest_size=8).hexdigest()


def merge_step_metrics(own: Mapping[str, Any], worker: Mapping[str, Any]) -> dict[str, Any]:
    """The loop's own keys plus the worker's dict, its keys unchanged; a clash is an error.

    The worker's ``moe/`` and ``train_perf/`` keys go through exactly once, never re-prefixed.
    """
    clash = sorted(set(own) & set(worker))
    if clash:
        raise ValueError(f"loop and worker both produced {clash}; rename the loop's keys")
    merged = dict(worker)
    merged.update(own)
    return merged


def worker_result(
    metrics: Mapping[str, Any],
    *,
    step: int,
    rank: int | None = None,
    node: str | None = None,
    full: bool | None = None,
) -> WorkerResult:
    """Wrap a worker's step dict for the trip to the driver.

    ``rank`` defaults to this process's torch.distributed rank (``RANK`` without a process
    group); ``node`` to the Ray node id when running in a Ray actor, else the host name.
    ``full`` (default: rank 0 only) carries the dict itself; the other ranks send its keys'
    digest, so at 1,024 ranks the driver receives one dict (the expert table once), not 1,024.
    """
    if rank is None:
        rank = _this_rank()
    if node is None:
        node = _this_node()
    if full is None:
        full = rank == 0
    return WorkerResult(
        rank=int(rank),
        step=int(step),
        metrics=dict(metrics) if full else {},
        node=node,
        keys=key_digest(metrics),
    )


def merge_worker_results(
    results: Iterable[WorkerResult], own: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One step's keys from every worker's result, plus the driver's own keys (``own``).

    The results must be one step's (the same ``step``), from distinct ranks, with the same
    keys (``finish_step`` returns the same dict on every rank: their digests must agree); the
    values of the lowest rank that sent its dict are taken as they are. A driver key that a
    worker also produced is an error, never a silent overwrite. ValueError says which rank or
    key is wrong.
    """
    got = sorted(results, key=lambda r: r.rank)
    if not got:
        raise ValueError("merge_worker_results: no worker results (call every worker's train)")
    steps = {r.step for r in got}
    if len(steps) > 1:
        by_step = ", ".join(f"rank {r.rank}: step {r.step}" for r in got)
        raise ValueError(f"worker results of different steps ({by_step}); merge one step at a time")
    ranks = [r.rank for r in got]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"worker results with repeated ranks {ranks}: pass one result per rank")
    carriers = [r for r in got if r.metrics]
    if not carriers:
        raise ValueError(
            f"none of ranks {ranks} sent its step dict (worker_result(..., full=True) on one "
            "rank; by default rank 0 sends it): pass rank 0's result too"
        )
    first = carriers[0]
    digest = first.keys or key_digest(first.metrics)
    for other in got:
        theirs = other.keys or (key_digest(other.metrics) if other.metrics else digest)
        if theirs != digest:
            differ = sorted(set(other.metrics) ^ set(first.metrics))[:5] if other.metrics else []
            raise ValueError(
                f"rank {other.rank} returned other keys than rank {first.rank}"
                + (f" ({differ})" if differ else "")
                + ": every rank of the group must call finish_step for the same step and return "
                "its dict"
            )
    return merge_step_metrics(own or {}, first.metrics)


def log_worker_results(
    results: Iterable[WorkerResult], sink: StepSink, own: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge one step's worker results (:func:`merge_worker_results`) with the driver's own keys
    and log them to ``sink`` (the run directory, TensorBoard, W&B, ... of ``build_sinks``) at
    the results' step; the merged dict."""
    got = list(results)
    merged = merge_worker_results(got, own)
    sink.log(merged, got[0].step)
    return merged


def _this_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _this_node() -> str:
    import socket
    import sys

    ray = sys.modules.get("ray")  # only when this process already runs Ray (an actor)
    if ray is not None and ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


__all__ = [
    "StepSink",
    "WorkerResult",
    "key_digest",
    "log_worker_results",
    "merge_step_metrics",
    "merge_worker_results",
    "worker_result",
]
