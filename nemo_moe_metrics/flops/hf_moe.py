"""Hugging Face MoE decoders with softmax attention: qwen2_moe, qwen3_moe, mixtral, olmoe,
gpt_oss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.flops.components import ConfigReader, dense_mlp, moe_block
from nemo_moe_metrics.flops.core import DenseMLP, FlopsEstimator, Layer, ModelShape, MoEMLP
from nemo_moe_metrics.flops.hf_dense import hf_attention, num_layers, tied


def qwen_moe_layer_is_sparse(cfg: ConfigReader, layer: int) -> bool:
    """Qwen MoE layer rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``."""
    mlp_only = set(cfg.get("mlp_only_layers", []))
    step = int(cfg.get("decoder_sparse_step", 1))
    experts = int(cfg.get("num_experts", 0))
    return layer not in mlp_only and experts > 0 and (layer + 1) % step == 0


def qwen_moe_ffn(cfg: ConfigReader, layer: int, *, shared: bool) -> DenseMLP | MoEMLP:
    """The feed-forward block of a Qwen MoE layer (qwen2_moe, qwen3_moe, qwen3_next)."""
    hidden = int(cfg.require("hidden_size"))
    if not qwen_moe_layer_is_sparse(cfg, layer):
        return dense_mlp(hidden, int(cfg.require("intermediate_size")))
    return moe_block(
        hidden,
        num_experts=int(cfg.require("num_experts")),
        top_k=int(cfg.require("num_experts_per_tok")),
        expert_width=int(cfg.require("moe_intermediate_size")),
        shared_width=int(cfg.get("shared_expert_intermediate_size", 0)) if shared else 0,
        shared_gate=shared,
    )


def qwen3_moe(config: Mapping[str, Any]) -> FlopsEstimator:
    """qwen3_moe: experts of width ``moe_intermediate_size``; dense layers per the sparse rule."""
    cfg = ConfigReader(config, "qwen3_moe")
    hidden = int(cfg.require("hidden_size"))
    layers = tuple(
        Layer(hf_attention(cfg, i), qwen_moe_ffn(cfg, i, shared=False))
        for i in range(num_layers(cfg))
    )
    return FlopsEstimator(ModelShape("qwen3_moe", hidden, layers, cfg.vocab_size(), tied(cfg)))


def qwen2_moe(config: Mapping[str, Any]) -> FlopsEstimator:
    """qwen2_moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): as qwen3_moe, plus in every sparse layer
    a shared expert of width ``shared_expert_intermediate_size`` that sees every token, scaled
    by a sigmoid gate (a ``hidden x 1`` projection). The q/k/v biases add no matmul FLOPs."""
    cfg = ConfigReader(config, "qwen2_moe")
    hidden = int(cfg.require("hidden_size"))
    layers = tuple(
        Layer(hf_attention(cfg, i), qwen_moe_ffn(cfg, i, shared=True))
        for i in range(num_layers(cfg))
    )
    return FlopsEstimator(ModelShape("qwen2_moe", hidden, layers, cfg.vocab_size(), tied(cfg)))


def _all_moe(
    config: Mapping[str, Any],
    model_type: str,
    num_experts_keys: tuple[str, ...],
    top_k_keys: tuple[str, ...],
    default_tied: bool = False,
) -> FlopsEstimator:
    cfg = ConfigReader(config, model_type)
    hidden = int(cfg.require("hidden_size"))
    ffn = moe_block(
        hidden,
        num_experts=int(cfg.first(*num_experts_keys)),
        top_k=int(cfg.first(*top_k_keys)),
        # These families name the expert width intermediate_size.
        expert_width=int(cfg.require("intermediate_size")),
    )
    layers = tuple(Layer(hf_attention(cfg, i), ffn) for i in range(num_layers(cfg)))
    return FlopsEstimator(
        ModelShape(model_type, hidden, layers, cfg.vocab_size(), tied(cfg, default_tied))
    )


def mixtral(config: Mapping[str, Any]) -> FlopsEstimator:
    """mixtral: ``num_local_experts`` experts of width ``intermediate_size`` in every layer."""
    return _all_moe(config, "mixtral", ("num_local_experts",), ("num_experts_per_tok",))


def olmoe(config: Mapping[str, Any]) -> FlopsEstimator:
    """olmoe: ``num_experts`` experts of width ``intermediate_size`` in every layer."""
    return _all_moe(config, "olmoe", ("num_experts",), ("num_experts_per_tok",))


def gpt_oss(config: Mapping[str, Any]) -> FlopsEstimator:
    """gpt_oss: alternating sliding/full attention (``layer_types``), MoE in every layer."""
    config = dict(config)
    if config.get("layer_types") is None:
        n = int(ConfigReader(config, "gpt_oss").require("num_hidden_layers"))
        # The config class's default: even layers slide, odd layers attend fully.
        config["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
        ]
    return _all_moe(
        config,
        "gpt_oss",
        ("num_local_experts", "num_experts"),
        ("num_experts_per_tok", "experts_per_token"),
    )
