"""Tiny random-init Hugging Face MoE configs (8 experts, top-2, eager attention and experts)."""

from __future__ import annotations

from typing import Any

E, K, VOCAB = 8, 2, 64

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
    num_experts_per_tok=K, attn_implementation="eager", max_position_embeddings=64,
)  # fmt: skip


def tiny_config(family: str) -> Any:
    """A 2- or 3-layer config of ``family`` with the eager code paths FlopCounter/CPU need."""
    import transformers as t

    if family == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(**_COMMON, intermediate_size=32, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, num_hidden_layers=2,
                               num_experts=E, decoder_sparse_step=1,
                               mlp_only_layers=[])  # fmt: skip
    elif family == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(**_COMMON, intermediate_size=32, moe_intermediate_size=16,
                               num_hidden_layers=2, head_dim=16, num_experts=E,
                               decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    elif family == "mixtral":
        cfg = t.MixtralConfig(**_COMMON, intermediate_size=16, num_hidden_layers=2,
                              num_local_experts=E)  # fmt: skip
    elif family == "olmoe":
        cfg = t.OlmoeConfig(**_COMMON, intermediate_size=16, num_hidden_layers=2, num_experts=E)
    elif family == "gpt_oss":
        cfg = t.GptOssConfig(**_COMMON, intermediate_size=16, num_hidden_layers=2, head_dim=16,
                             num_local_experts=E, layer_types=["sliding_attention",
                             "full_attention"], sliding_window=8)  # fmt: skip
    elif family == "deepseek_v3":
        cfg = t.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 2}, intermediate_size=32,
                                 moe_intermediate_size=16, num_hidden_layers=3,
                                 first_k_dense_replace=1, n_routed_experts=E, n_shared_experts=1,
                                 n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
    elif family == "qwen3_next":
        cfg = t.Qwen3NextConfig(**_COMMON, intermediate_size=32, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16, num_hidden_layers=2,
                                head_dim=16, num_experts=E, decoder_sparse_step=1,
                                mlp_only_layers=[], layer_types=["linear_attention",
                                "full_attention"], linear_num_value_heads=2,
                                linear_num_key_heads=1, linear_key_head_dim=8,
                                linear_value_head_dim=8)  # fmt: skip
    elif family == "qwen3_5_moe":
        text = dict(**_COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                    num_hidden_layers=2, head_dim=16, num_experts=E,
                    layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                    linear_num_key_heads=1, linear_key_head_dim=8,
                    linear_value_head_dim=8)  # fmt: skip
        text.pop("attn_implementation")
        cfg = t.Qwen3_5MoeTextConfig(**text, attn_implementation="eager")
    else:
        raise ValueError(f"no tiny config for {family!r}")
    cfg._experts_implementation = "eager"
    return cfg


FAMILIES = [
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5_moe",
]


def tiny_model(family: str, seed: int = 0) -> Any:
    """A random-init causal LM of ``family`` in train mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).train()
