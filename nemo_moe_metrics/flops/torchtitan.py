"""torchtitan model configs (DeepSeek-V3, Qwen3 and Qwen3 MoE families): FLOPs from the config.

torchtitan keeps one block config per layer (``config.layers``), so the shape is read layer by
layer: multi-head latent attention when the attention config has ``wkv_a`` (DeepSeek-V3),
grouped-query attention otherwise (Qwen3); a block with ``moe`` is an MoE layer (routed experts
of width ``routed_experts.inner_experts.hidden_dim``, ``router.top_k`` per token, shared
experts of width ``shared_experts.w1.out_features``), else a dense SwiGLU feed-forward. The
multi-token-prediction layers (``mtp_layers``) are not counted, as for Hugging Face DeepSeek-V3.
Conventions as everywhere (``flops.core``): multiply-add = 2 FLOPs, training = 3 x forward.
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.flops.components import dense_mlp, gqa_attention, mla_attention, moe_block
from nemo_moe_metrics.flops.core import FlopsEstimator, Layer, ModelShape

#: The torchtitan model families whose configs this module reads (docs/en/flops.md).
TORCHTITAN_FAMILIES = ("deepseek_v3", "qwen3", "qwen3_moe")


def is_torchtitan_config(config: Any) -> bool:
    """A torchtitan model config (a dataclass from the torchtitan package with ``layers``)."""
    module = type(config).__module__ or ""
    return module.split(".")[0] == "torchtitan" and isinstance(
        getattr(config, "layers", None), list | tuple
    )


def _attention(cfg: Any, hidden: int):
    if getattr(cfg, "wkv_a", None) is not None:
        return mla_attention(
            hidden,
            int(cfg.n_heads),
            q_lora_rank=int(cfg.q_lora_rank or 0) or None,
            kv_lora_rank=int(cfg.kv_lora_rank),
            qk_nope_head_dim=int(cfg.qk_nope_head_dim),
            qk_rope_head_dim=int(cfg.qk_rope_head_dim),
            v_head_dim=int(cfg.v_head_dim),
        )
    heads = int(cfg.n_heads)
    kv_heads = int(cfg.n_kv_heads or heads)
    head_dim = int(cfg.head_dim or hidden // heads)
    return gqa_attention(hidden, heads, kv_heads, head_dim)


def _ffn(block: Any, hidden: int):
    moe = getattr(block, "moe", None)
    if moe is None:
        return dense_mlp(hidden, int(block.feed_forward.w1.out_features))
    shared = getattr(moe, "shared_experts", None)
    return moe_block(
        hidden,
        num_experts=int(moe.num_experts),
        top_k=int(moe.router.top_k),
        expert_width=int(moe.routed_experts.inner_experts.hidden_dim),
        shared_width=int(shared.w1.out_features) if shared is not None else 0,
    )


def torchtitan_flops_estimator(config: Any, *, vocab_size: int | None = None) -> FlopsEstimator:
    """The estimator of a torchtitan ``Decoder.Config`` (``DeepSeekV3Model.Config``, ...)."""
    hidden = int(config.dim)
    layers = tuple(Layer(_attention(b.attention, hidden), _ffn(b, hidden)) for b in config.layers)
    mtp = tuple(
        Layer(_attention(b.attention, hidden), _ffn(b, hidden))
        for b in getattr(config, "mtp_layers", None) or ()
    )
    vocab = int(config.vocab_size if vocab_size is None else vocab_size)
    family = "torchtitan_" + type(config).__qualname__.split(".")[0].lower().replace("model", "")
    tied = bool(getattr(config, "enable_weight_tying", False))
    return FlopsEstimator(ModelShape(family, hidden, layers, vocab, tied, mtp_layers=mtp))
