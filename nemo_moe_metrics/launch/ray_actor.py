"""One rank of the Ray worker group: a :class:`MegatronPolicyWorker` inside a Ray actor.

NeMo RL's shape: the actor joins the group's torch.distributed process group (gloo on CPU,
NCCL on GPUs) with the rank the driver gives it, builds the same worker and metrics as a
torchrun rank (:func:`nemo_moe_metrics.launch.recipe_run.make_metrics`), and answers the driver's
calls (:mod:`.ray_group`) with CPU tensors and, per training step, a
:class:`~nemo_moe_metrics.worker.results.WorkerResult` whose metrics were reduced inside the
group. This module does not import ``ray`` at import time; :mod:`.ray_group` makes the class
an actor.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
from nemo_moe_metrics.config import Recipe
from nemo_moe_metrics.launch.recipe_run import make_metrics
from nemo_moe_metrics.worker.results import WorkerResult, worker_result


class MegatronPolicyActor:
    """A Ray actor holding one rank's :class:`MegatronPolicyWorker` (built by :meth:`setup`)."""

    def __init__(self) -> None:
        """Pin the intra-op threads as a torchrun rank does (``OMP_NUM_THREADS``, 1 on CPU)."""
        threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        if not torch.cuda.is_available():
            torch.set_num_threads(threads)
        self.worker: Any = None
        self.rank = -1

    def where(self) -> dict[str, Any]:
        """Where this actor runs: pid, host, Ray node id and address, visible GPUs."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": str(ctx.get_node_id()),
            "node_ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        }

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's: the process group meets there)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup(
        self,
        recipe_data: dict[str, Any],
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        totals: tuple[float, float, float] | None = None,
    ) -> dict[str, int]:
        """Join the process group as ``rank`` of ``world_size`` and build the worker and its
        metrics (resuming the ``train_perf/`` totals when given); returns this rank's
        data-parallel rank and size. Every actor of the group must be called together."""
        # The env:// rendezvous torchrun would give: megatron's init_distributed reads it.
        # One GPU per actor (Ray sets CUDA_VISIBLE_DEVICES), so its local index is 0.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0",
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        recipe = Recipe.model_validate(recipe_data)
        metrics = make_metrics(recipe)
        if metrics is not None and totals is not None:
            metrics.resume_totals(*totals)
        self.rank = rank
        self.worker = MegatronPolicyWorker(recipe, metrics=metrics)
        return {"dp_rank": int(self.worker.dp_rank), "dp_size": int(self.worker.dp_size)}

    def generate(
        self,
        prompts: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generator_state: torch.Tensor,
        precision: str = "fp32",
    ) -> torch.Tensor:
        """Sample as the SPMD loop does, from the driver's generator state (same samples)."""
        g = torch.Generator()
        g.set_state(generator_state)
        extra = {} if precision == "fp32" else {"precision": precision}
        seqs = self.worker.generate(prompts, max_new_tokens, temperature, generator=g, **extra)
        return seqs.cpu()

    def logprobs(self, batch: Any) -> torch.Tensor:
        """Next-token log-probabilities of ``batch`` (no grad), on the CPU."""
        return self.worker.logprobs(batch).cpu()

    def snapshot_reference(self) -> None:
        """Keep the current weights as the reference policy (DPO)."""
        self.worker.snapshot_reference()

    def reference_logprobs(self, batch: Any) -> torch.Tensor:
        """Log-probabilities under the reference weights, on the CPU."""
        with self.worker.reference_weights():
            return self.worker.logprobs(batch).cpu()

    def rollout_routes(self, batch: Any, precision: str) -> torch.Tensor:
        """The rollout forward's expert routes, on the CPU."""
        return self.worker.rollout_routes(batch, precision).cpu()

    def train(self, batch: Any, loss_fn: Any, step: int) -> WorkerResult:
        """One optimizer step (collective); the step's metrics, reduced in the group."""
        return worker_result(self.worker.train(batch, loss_fn), step=step, rank=self.rank)

    def close(self) -> None:
        """Leave the process group (every actor together, after the last step)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


__all__ = ["MegatronPolicyActor"]
