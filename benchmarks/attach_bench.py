"""How long ``PolicyMetrics.attach`` takes on a deep Hugging Face MoE model, every flag on.

The model is GLM-4.5's transformers family (``glm4_moe``: no registered FLOP formula, so attach
derives the estimate from the model's modules) with 94 layers of 128 experts, built on the
meta device: attach walks modules and registers hooks, it computes nothing, so the cost is the
same as on a real device without allocating 200 B parameters.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any


def attach_bench(layers: int = 94, experts: int = 128, repeats: int = 3) -> dict[str, Any]:
    """Median seconds of ``attach`` (every MoE flag, throughput, FLOPs, router health)."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from nemo_moe_metrics import PolicyMetrics
    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.families.throughput import Throughput

    config = Glm4MoeConfig(num_hidden_layers=layers, n_routed_experts=experts)
    config._experts_implementation = "eager"
    cfg = MetricsConfig(
        track_moe_metrics=True,
        moe_per_layer_logging=True,
        track_throughput=True,
        track_flops=True,
        track_router_health=True,
    )
    times = []
    for _ in range(repeats):
        with torch.device("meta"):
            model = Glm4MoeForCausalLM(config)
        metrics = PolicyMetrics(cfg)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metrics.attach(model, model.config)
        times.append(time.perf_counter() - started)
        routers = len(metrics._collector.layer_ids)
        throughput = metrics.family(Throughput)
        flops = throughput is not None and throughput.meter._estimator is not None
        metrics.detach()
    return {
        "attach_seconds": statistics.median(times),
        "layers": layers,
        "experts": experts,
        "checks": {
            "attach_hooks_every_moe_layer": routers == layers - 1,
            "attach_costs_flops": flops,
        },
    }
