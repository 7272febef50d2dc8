"""A Ray driver and its policy workers with PolicyMetrics: NeMo RL's, verl's or AReaL's shape.

Run it (a CPU is enough: an embedded local Ray with 2 actors, gloo between them)::

    python examples/integrate_ray.py --out /tmp/ray_run
    nemo-moe-metrics report /tmp/ray_run      # (this script also prints the report)

With ``RAY_ADDRESS`` (or ``--ray-address``) set, it joins that running cluster instead.
One driver process runs the loop; each rank is a Ray actor (``PolicyWorker``) holding a tiny
megatron-core MoE GPT (``integrate_megatron.py``'s) and a ``PolicyMetrics``; the actors form
one torch.distributed group (expert parallel across them). Lines marked ``# (metrics)`` are
the integration: in the worker, the five calls and ``worker_result``; on the driver,
``build_sinks`` and ``log_worker_results``, which merges the workers' results (reduced inside
their group, never again) into the run directory. docs/en/ray.md walks through it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES))  # integrate_megatron.py: the model, data and loss

import torch  # noqa: E402

from nemo_moe_metrics import build_sinks  # noqa: E402
from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.ray import log_worker_results, worker_result  # noqa: E402
from nemo_moe_metrics.runtime.extras import MissingExtraError, check_extra  # noqa: E402


class PolicyWorker:
    """One rank of the policy, as a framework's Ray actor (NeMo RL's MegatronPolicyWorker)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's: the process group meets here)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, world: int, addr: str, port: int, expert_parallel: int) -> None:
        """Join the process group, build the model and optimizer, attach the metrics."""
        import torch.distributed as dist
        from integrate_megatron import NUM_EXPERTS, VOCAB, build_model, transformer_config
        from megatron.core import parallel_state

        from nemo_moe_metrics import PolicyMetrics
        from nemo_moe_metrics.megatron.cpu_shims import apply_cpu_shims

        torch.set_num_threads(1)  # cpu-only: two ranks on two cores
        apply_cpu_shims()  # cpu-only (a no-op when CUDA is available)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
        torch.manual_seed(1234)
        self.rank, self.num_experts = rank, NUM_EXPERTS
        self.config = transformer_config(expert_parallel)
        self.model = build_model(self.config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.metrics = PolicyMetrics(  # (metrics)
            MetricsConfig(track_moe_metrics=True, track_throughput=True, track_flops=True),
            vocab_size=VOCAB,
        )
        self.metrics.attach(self.model, self.config)  # (metrics) once, after the model is built

    def facts(self) -> Any:
        """What attach read from the model (layers, experts, top-k, EP size) for run.json."""
        return self.metrics.facts  # (metrics)

    def train(self, step: int, num_microbatches: int = 2) -> Any:
        """One optimizer step; returns the step's metrics for the driver (a WorkerResult)."""
        from integrate_megatron import MICRO_BATCH, SEQ, forward_step, microbatches, sync_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode

        self.optimizer.zero_grad(set_to_none=True)
        with self.metrics.step():  # (metrics) one optimizer step
            with cpu_device_mode():  # cpu-only: megatron's schedules allocate on "cuda"
                get_forward_backward_func()(
                    forward_step_func=partial(forward_step, self.metrics),  # (metrics) inside
                    data_iterator=iter(microbatches(self.rank, step, num_microbatches)),
                    model=self.model,
                    num_microbatches=num_microbatches,
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=False,
                )
            sync_grads(self.model)
            self.optimizer.step()
        out = self.metrics.finish_step(num_microbatches=num_microbatches)  # (metrics) collective
        return worker_result(out, step=step)  # (metrics) what the remote call returns


def main(argv: list[str] | None = None) -> int:
    """The driver: start the workers, run the loop, log the merged keys, print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (the driver's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="ranks: one Ray actor each")
    parser.add_argument("--ray-address", default=None, help="default: RAY_ADDRESS, else local")
    args = parser.parse_args(argv)
    try:
        check_extra("launch", "examples/integrate_ray.py (Ray)")
        check_extra("megatron", "examples/integrate_ray.py")
    except MissingExtraError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import ray

    from nemo_moe_metrics.launch.ray_cluster import connect

    # ray.init(): the cluster at --ray-address / RAY_ADDRESS, or an embedded local Ray whose
    # token stays in this process's environment (nothing written to the home directory).
    session = connect(args.ray_address)
    # The workers import integrate_megatron.py and this package from this checkout.
    path = os.pathsep.join(filter(None, [str(EXAMPLES), str(EXAMPLES.parent), os.environ.get(
        "PYTHONPATH")]))  # fmt: skip
    # The worker class by its module name (this file, importable on the workers' path), so
    # Ray sends its name, not its code: a class of __main__ would be pickled with its globals.
    from integrate_ray import PolicyWorker as Worker

    actor = ray.remote(num_cpus=1)(Worker).options(
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
    )
    workers = [actor.remote() for _ in range(args.workers)]
    try:
        addr, port = ray.get(workers[0].address.remote(), timeout=300)
        ray.get(
            [w.setup.remote(r, args.workers, addr, port, args.workers)
             for r, w in enumerate(workers)],
            timeout=300,
        )  # fmt: skip
        sink = build_sinks(  # (metrics) the driver owns the run directory
            LoggerConfig(wandb_enabled=False, tensorboard_enabled=False, table_every=1),
            args.out,
            run_name="integrate_ray",
            facts=ray.get(workers[0].facts.remote(), timeout=60),  # (metrics) run.json's shape
        )
        for step in range(args.steps):
            start = time.perf_counter()
            results = ray.get([w.train.remote(step) for w in workers], timeout=600)
            own = {"driver/step_seconds": time.perf_counter() - start}  # the driver's own keys
            log_worker_results(results, sink, own=own)  # (metrics) merge, log, once per step
        sink.close()
    finally:
        for w in workers:
            ray.kill(w)
        session.shutdown()
    from nemo_moe_metrics.report import render_report

    print(render_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
