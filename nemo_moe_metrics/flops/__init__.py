"""Model-aware training FLOP estimates (forward + backward) and accelerator peaks for MFU.

    est = get_flops_estimator(config)            # HF config, config.json dict, TransformerConfig
    flops = est([4096, 4096, 1024], causal=True)  # one entry per (packed) sequence
    flops.total, flops.by_component["routed_experts"]

Conventions and what is not counted: nemo_moe_metrics.flops.core and docs/en/flops.md.
"""

from nemo_moe_metrics.flops.core import (
    COMPONENTS,
    AttentionIndexer,
    AttentionLayer,
    ChunkedWindow,
    CompressedWindow,
    DenseMLP,
    FlopsBreakdown,
    FlopsEstimator,
    Layer,
    LinearAttentionLayer,
    MambaLayer,
    ModelShape,
    MoEMLP,
    ParameterCounts,
    PooledWindow,
    ShortConvLayer,
)
from nemo_moe_metrics.flops.fixtures import fixture_names, load_fixture
from nemo_moe_metrics.flops.peaks import peak_flops_per_second, resolve_peak_flops
from nemo_moe_metrics.flops.registry import (
    UnknownModelTypeError,
    get_flops_estimator,
    register_flops_estimator,
    registered_model_types,
    try_get_flops_estimator,
)

__all__ = [
    "COMPONENTS",
    "AttentionIndexer",
    "AttentionLayer",
    "ChunkedWindow",
    "CompressedWindow",
    "DenseMLP",
    "FlopsBreakdown",
    "FlopsEstimator",
    "Layer",
    "LinearAttentionLayer",
    "MambaLayer",
    "ModelShape",
    "MoEMLP",
    "ParameterCounts",
    "PooledWindow",
    "ShortConvLayer",
    "UnknownModelTypeError",
    "fixture_names",
    "get_flops_estimator",
    "load_fixture",
    "peak_flops_per_second",
    "register_flops_estimator",
    "registered_model_types",
    "resolve_peak_flops",
    "try_get_flops_estimator",
]
