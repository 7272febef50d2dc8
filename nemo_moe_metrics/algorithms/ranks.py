"""The policy as the loops see it: a group of ranks fed one batch per data-parallel rank.

One loop body serves both engines. Under torchrun every process runs the loop for itself
(SPMD): :class:`LocalRanks` wraps this rank's worker and the loop builds only its own
data-parallel share. Under Ray one driver runs the loop for every rank
(:class:`nemo_moe_metrics.launch.ray_group.RayWorkerGroup`): the loop builds the share of every
data-parallel rank and the group sends each actor its own. Either way a step's batch of
data-parallel rank ``d`` comes from ``generator(seed, step, d)``, so both engines train on the
same data.

The interface (every mapping is keyed by data-parallel rank, one entry per rank in
``dp_ranks``):

- ``dp_size``, ``dp_ranks``: how many data-parallel ranks there are, and whose data this
  process provides (SPMD: its own; a driver: all);
- ``generate(prompts, max_new_tokens, temperature, generators, precision=...)``: sampled
  sequences, on the CPU;
- ``logprobs(batches)``, ``reference_logprobs(batches)``, ``rollout_routes(batches,
  precision)``, ``snapshot_reference()``: as the worker's methods (the reference is scored with
  the weights ``snapshot_reference`` kept);
- ``train(batches, loss_fn) -> dict``: one optimizer step on every rank; the step's metrics,
  reduced inside the ranks' process group (the same dict on every rank);
- ``mean_over_dp(values) -> dict``: the mean of the loop's own scalars over every
  data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_moe_metrics.algorithms.common import dp_mean


class LocalRanks:
    """The group of one SPMD process: this rank's worker, fed its own data-parallel share."""

    def __init__(self, worker: Any) -> None:
        """``worker``: a :class:`~nemo_moe_metrics.algorithms.megatron_policy.MegatronPolicyWorker`
        (or an object with its methods and ``dp_rank``, ``dp_size``, ``dp_group``)."""
        self.worker = worker

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the whole job."""
        return int(self.worker.dp_size)

    @property
    def dp_ranks(self) -> list[int]:
        """This process's own data-parallel rank: the only share it builds."""
        return [int(self.worker.dp_rank)]

    def _own(self, values: Mapping[int, Any]) -> tuple[int, Any]:
        (dp_rank,) = self.dp_ranks
        return dp_rank, values[dp_rank]

    def generate(
        self,
        prompts: Mapping[int, torch.Tensor],
        max_new_tokens: int,
        temperature: float,
        generators: Mapping[int, torch.Generator],
        precision: str = "fp32",
    ) -> dict[int, torch.Tensor]:
        """This rank's sampled sequences ``[n, p + max_new_tokens]`` on the CPU."""
        d, own = self._own(prompts)
        extra = {} if precision == "fp32" else {"precision": precision}
        seqs = self.worker.generate(
            own, max_new_tokens, temperature, generator=generators[d], **extra
        )
        return {d: seqs.cpu()}

    def logprobs(self, batches: Mapping[int, Any]) -> dict[int, torch.Tensor]:
        """This rank's next-token log-probabilities (no grad)."""
        d, batch = self._own(batches)
        return {d: self.worker.logprobs(batch)}

    def snapshot_reference(self) -> None:
        """Keep the current weights as the frozen reference (DPO)."""
        self.worker.snapshot_reference()

    def reference_logprobs(self, batches: Mapping[int, Any]) -> dict[int, torch.Tensor]:
        """Log-probabilities under the reference weights, swapped into the same model."""
        d, batch = self._own(batches)
        with self.worker.reference_weights():
            return {d: self.worker.logprobs(batch)}

    def rollout_routes(self, batches: Mapping[int, Any], precision: str) -> dict[int, torch.Tensor]:
        """The rollout forward's expert routes ``[b, s, moe_layers, top_k]`` on the CPU."""
        d, batch = self._own(batches)
        return {d: self.worker.rollout_routes(batch, precision).cpu()}

    def train(self, batches: Mapping[int, Any], loss_fn: Any) -> dict[str, Any]:
        """One optimizer step on this rank's share; the step's (reduced) metrics."""
        _, batch = self._own(batches)
        return self.worker.train(batch, loss_fn)

    def mean_over_dp(self, values: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """The mean over every data-parallel rank (one all-reduce; identity on one rank)."""
        _, own = self._own(values)
        return dp_mean(dict(own), self.worker.dp_group, self.dp_size)


def as_rank_group(worker_or_group: Any) -> Any:
    """A rank group as is (it has ``dp_ranks``); a single worker wrapped in :class:`LocalRanks`."""
    if hasattr(worker_or_group, "dp_ranks"):
        return worker_or_group
    return LocalRanks(worker_or_group)


__all__ = ["LocalRanks", "as_rank_group"]
