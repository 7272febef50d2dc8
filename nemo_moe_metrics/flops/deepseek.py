"""DeepSeek-V3: multi-head latent attention, dense first layers, shared and routed experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.flops.components import ConfigReader, dense_mlp, mla_attention, moe_block
from nemo_moe_metrics.flops.core import FlopsEstimator, Layer, ModelShape
from nemo_moe_metrics.flops.hf_dense import num_layers, tied


def deepseek_v3(config: Mapping[str, Any]) -> FlopsEstimator:
    """deepseek_v3: layers below ``first_k_dense_replace`` are dense, the rest MoE.

    The multi-token-prediction module (``num_nextn_predict_layers``) is not part of the
    Hugging Face model and is not counted.
    """
    cfg = ConfigReader(config, "deepseek_v3")
    hidden = int(cfg.require("hidden_size"))
    attention = mla_attention(
        hidden,
        int(cfg.require("num_attention_heads")),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg.require("kv_lora_rank")),
        qk_nope_head_dim=int(cfg.require("qk_nope_head_dim")),
        qk_rope_head_dim=int(cfg.require("qk_rope_head_dim")),
        v_head_dim=int(cfg.require("v_head_dim")),
    )
    dense = dense_mlp(hidden, int(cfg.require("intermediate_size")))
    width = int(cfg.require("moe_intermediate_size"))
    moe = moe_block(
        hidden,
        num_experts=int(cfg.require("n_routed_experts")),
        top_k=int(cfg.require("num_experts_per_tok")),
        expert_width=width,
        shared_width=width * int(cfg.get("n_shared_experts", 0)),
    )
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    layers = tuple(
        Layer(attention, dense if i < first_dense else moe) for i in range(num_layers(cfg))
    )
    return FlopsEstimator(ModelShape("deepseek_v3", hidden, layers, cfg.vocab_size(), tied(cfg)))
