"""Qwen hybrids with Gated DeltaNet layers: qwen3_next, qwen3_5 (dense), qwen3_5_moe.

Full-attention layers fold a sigmoid output gate into ``q_proj`` (twice the query width);
linear-attention layers are Gated DeltaNet (projections, depthwise causal conv, recurrence).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.flops.components import (
    ConfigReader,
    dense_mlp,
    gated_delta_net_from_config,
    moe_block,
)
from nemo_moe_metrics.flops.core import DenseMLP, FlopsEstimator, Layer, ModelShape, MoEMLP
from nemo_moe_metrics.flops.hf_dense import hf_attention, num_layers, tied
from nemo_moe_metrics.flops.hf_moe import qwen_moe_ffn


def _layer_types(cfg: ConfigReader) -> list[str]:
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        n = int(cfg.require("num_hidden_layers"))
        interval = int(cfg.get("full_attention_interval", 4))
        # The config classes' default: every interval-th layer is full attention.
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
        ]
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{cfg.model_type}: unknown layer_types {unknown}")
    return list(layer_types)


def _hybrid(config: Mapping[str, Any], model_type: str, ffn_for_layer) -> FlopsEstimator:
    cfg = ConfigReader(config, model_type)
    config = dict(config)
    config["layer_types"] = _layer_types(cfg)
    cfg = ConfigReader(config, model_type)
    hidden = int(cfg.require("hidden_size"))
    gdn = gated_delta_net_from_config(cfg, hidden)
    layers = []
    for i in range(num_layers(cfg)):
        if config["layer_types"][i] == "linear_attention":
            mixer = gdn
        else:
            mixer = hf_attention(cfg, i, output_gate=True)
        layers.append(Layer(mixer, ffn_for_layer(cfg, i)))
    return FlopsEstimator(
        ModelShape(model_type, hidden, tuple(layers), cfg.vocab_size(), tied(cfg))
    )


def qwen3_next(config: Mapping[str, Any]) -> FlopsEstimator:
    """qwen3_next: hybrid mixers; MoE with a gated shared expert, honouring the sparse rule."""
    return _hybrid(config, "qwen3_next", lambda cfg, i: qwen_moe_ffn(cfg, i, shared=True))


def _qwen3_5_dense_ffn(cfg: ConfigReader, layer: int) -> DenseMLP:
    return dense_mlp(int(cfg.require("hidden_size")), int(cfg.require("intermediate_size")))


def _qwen3_5_moe_ffn(cfg: ConfigReader, layer: int) -> MoEMLP:
    # Every qwen3_5_moe layer is sparse: the family has no mlp_only_layers/decoder_sparse_step.
    return moe_block(
        int(cfg.require("hidden_size")),
        num_experts=int(cfg.require("num_experts")),
        top_k=int(cfg.require("num_experts_per_tok")),
        expert_width=int(cfg.require("moe_intermediate_size")),
        shared_width=int(cfg.get("shared_expert_intermediate_size", 0)),
        shared_gate=True,
    )


def qwen3_5(config: Mapping[str, Any]) -> FlopsEstimator:
    """qwen3_5 (dense): hybrid mixers with a SwiGLU MLP of width ``intermediate_size``."""
    return _hybrid(config, "qwen3_5", _qwen3_5_dense_ffn)


def qwen3_5_moe(config: Mapping[str, Any]) -> FlopsEstimator:
    """qwen3_5_moe: hybrid mixers; every layer MoE with a gated shared expert."""
    return _hybrid(config, "qwen3_5_moe", _qwen3_5_moe_ffn)
