"""What runs inside a policy worker: the metrics facade and what a worker returns for a step.

- :mod:`.policy_metrics`: :class:`PolicyMetrics`, the five calls a training worker (or a
  framework) makes; it loops over the metric families (``nemo_moe_metrics.families``);
- :mod:`.results`: what a worker returns from one step (:class:`WorkerResult`), and a driver's
  merge of every worker's result.

``from nemo_moe_metrics.worker import PolicyMetrics`` is the worker API (also
``nemo_moe_metrics.PolicyMetrics``); ``ModelFacts`` is defined in
``nemo_moe_metrics.adapters.family``, ``model_facts`` in ``nemo_moe_metrics.adapters.registry``.
"""

from __future__ import annotations

from nemo_moe_metrics.worker.policy_metrics import ModelFacts, PolicyMetrics, model_facts
from nemo_moe_metrics.worker.results import (
    StepSink,
    WorkerResult,
    key_digest,
    log_worker_results,
    merge_step_metrics,
    merge_worker_results,
    worker_result,
)

__all__ = [
    "ModelFacts",
    "PolicyMetrics",
    "StepSink",
    "WorkerResult",
    "key_digest",
    "log_worker_results",
    "merge_step_metrics",
    "merge_worker_results",
    "model_facts",
    "worker_result",
]
