"""The estimate from a megatron-core TransformerConfig (flops/megatron.py) against independent
formulas: vocab size required, dense GQA, MLA with MoE, Gated DeltaNet."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    get_flops_estimator,
)
from tests.flops.test_core import llama_config

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


# --- megatron-core TransformerConfig -----------------------------------------------------


def test_megatron_config_needs_vocab_size():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="pass vocab_size="):
        get_flops_estimator(cfg)
    assert "lm_head" not in get_flops_estimator(cfg, vocab_size=0)([4]).by_component


def test_megatron_dense_gqa_equals_same_llama():
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        kv_channels=HD,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
    )
    ours = get_flops_estimator(cfg, vocab_size=V)([5, 50])
    assert ours.by_component == get_flops_estimator(llama_config())([5, 50]).by_component


def test_megatron_mla_moe_follows_independent_formula():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = MLATransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        moe_layer_freq=[0, 1],
    )
    out = get_flops_estimator(cfg, vocab_size=V)([1]).by_component
    q = H * 32 + 32 * HEADS * 24
    kv = H * (16 + 8) + 16 * HEADS * (16 + 12)
    o = HEADS * 12 * H
    assert out["attention_projections"] == 6 * 2 * (q + kv + o)
    assert out["dense_mlp"] == 6 * 3 * H * FFN
    assert out["routed_experts"] == 6 * 2 * 3 * H * 32
    assert out["shared_experts"] == 6 * (3 * H * 64 + H)
    assert out["router"] == 6 * H * 8


def test_megatron_gated_delta_net_and_output_gate():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        kv_channels=HD,
        ffn_hidden_size=FFN,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,  # layers 0-2 linear, layer 3 softmax attention
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=12,
        attention_output_gate=True,
    )
    out = get_flops_estimator(cfg, vocab_size=V)([1]).by_component
    kd, vd = 2 * 16, 4 * 12
    assert out["linear_attention_projections"] == 6 * 3 * (H * (2 * kd + 2 * vd + 2 * 4) + vd * H)
    assert out["linear_attention_conv"] == 6 * 3 * (2 * kd + vd) * 4
    assert out["linear_attention_core"] == 6 * 3 * 3 * 4 * 16 * 12
    q = 2 * HEADS * HD  # the output gate doubles q
    assert out["attention_projections"] == 6 * (H * (q + 2 * KV * HD) + HEADS * HD * H)
