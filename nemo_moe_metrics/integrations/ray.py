"""For frameworks that already have a Ray driver (NeMo RL, verl, AReaL, OpenRLHF).

Their shape: one driver process runs the loop; the policy is a group of Ray actors that form
one torch.distributed group; the driver calls ``worker.train(batch)`` on every actor and merges
what comes back. The metrics join in two places, and nothing else changes:

In each worker (the Ray actor), around its training step::

    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, ...), vocab_size=V)
    metrics.attach(model, transformer_config)          # once
    with metrics.step():                               # one optimizer step
        ...  metrics.microbatch(seq_lens=...)  ...     # per microbatch, before its forward
    out = metrics.finish_step(num_microbatches=n)      # collective, same dict on every rank
    return worker_result(out, step=step)               # what the remote train() returns

On the driver, once per step::

    results = ray.get([w.train.remote(batch, step) for w in workers])
    log_worker_results(results, sink, own={"train/reward": reward})   # keys + run directory

``sink`` is :func:`nemo_moe_metrics.build_sinks`'s (JSONL, the expert-load store,
TensorBoard, W&B, ...), opened on the driver: the driver owns the run directory, the workers
write nothing. The reduction stays inside the workers' process group; the driver only merges
(it takes the lowest rank's dict after checking the results belong together), so the numbers
are the ones an SPMD run's rank 0 would log. The expert table travels as arrays. Worked
example: ``examples/integrate_ray.py``; docs/en/ray.md. Nothing here imports ``ray``.
"""

from __future__ import annotations

from nemo_moe_metrics.worker.results import (
    StepSink,
    WorkerResult,
    log_worker_results,
    merge_worker_results,
    worker_result,
)

__all__ = [
    "StepSink",
    "WorkerResult",
    "log_worker_results",
    "merge_worker_results",
    "worker_result",
]
