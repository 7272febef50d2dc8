"""Observability for Mixture-of-Experts training with Megatron-core and NeMo-RL-style loops.

The public API is importable from the top level::

    from nemo_moe_metrics import PolicyMetrics, MetricsConfig, LoggerConfig, build_sinks

Names are resolved lazily (PEP 562): ``import nemo_moe_metrics`` alone imports nothing heavy,
and each name imports only the module that defines it, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the five calls every worker or framework makes, and their flags
    "PolicyMetrics": "nemo_moe_metrics.worker.policy_metrics",
    "MetricsConfig": "nemo_moe_metrics.config",
    "LoggerConfig": "nemo_moe_metrics.config",
    "AlertsConfig": "nemo_moe_metrics.config",
    "ConfigError": "nemo_moe_metrics.config",
    "Recipe": "nemo_moe_metrics.config",
    "load_recipe": "nemo_moe_metrics.config",
    # sinks
    "build_sinks": "nemo_moe_metrics.run_dir.session",
    "open_run": "nemo_moe_metrics.run_dir.session",
    "Sink": "nemo_moe_metrics.sinks.base",
    "read_expert_loads": "nemo_moe_metrics.sinks.store",
    # the rollout engine's own expert loads (docs/en/placement.md)
    "RolloutLoadRecorder": "nemo_moe_metrics.sinks.rollout_store",
    "record_rollout_loads": "nemo_moe_metrics.sinks.rollout_store",
    "counts_from_routes": "nemo_moe_metrics.sinks.rollout_store",
    # FLOP estimator
    "get_flops_estimator": "nemo_moe_metrics.flops",
    "register_flops_estimator": "nemo_moe_metrics.flops",
    "FlopsEstimator": "nemo_moe_metrics.flops",
    # throughput and expert loads without the worker
    "StepMeter": "nemo_moe_metrics.throughput",
    "ExpertLoadCollector": "nemo_moe_metrics.moe.collector",
    "attach_collector": "nemo_moe_metrics.adapters.registry",
    "model_facts": "nemo_moe_metrics.adapters.registry",
    "register_router": "nemo_moe_metrics.adapters.registry",
    "expert_load_metrics": "nemo_moe_metrics.moe.balance",
    # reading a run
    "render_report": "nemo_moe_metrics.report",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_moe_metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
