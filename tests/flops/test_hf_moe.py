"""Hugging Face MoE decoders with softmax attention (flops/hf_moe.py): gpt-oss's sliding layers,
head_dim read from the config, Qwen's MoE layer rule, gpt-oss's parameter count."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    get_flops_estimator,
    load_fixture,
)
from tests.flops.test_core import brute_pairs, llama_config

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


def test_gpt_oss_windows_only_its_sliding_layers():
    cfg = load_fixture("gpt-oss-120b")
    est = get_flops_estimator(cfg)
    n = 4096
    got = est([n]).by_component["attention_core"]
    width = cfg["num_attention_heads"] * 2 * cfg["head_dim"]
    per_layer_type = {"sliding_attention": brute_pairs(n, 128), "full_attention": n * (n + 1) // 2}
    pairs = sum(per_layer_type[t] for t in cfg["layer_types"])
    assert got == 3 * 2 * width * pairs


def test_head_dim_is_read_not_derived_from_hidden():
    # Qwen3-235B: head_dim 128 while hidden/heads = 64 (a 1.84x undercount if assumed).
    cfg = load_fixture("qwen3-235b-a22b")
    got = get_flops_estimator(cfg)([1]).by_component["attention_projections"]
    h, q, kv = (
        cfg["hidden_size"],
        cfg["num_attention_heads"] * 128,
        cfg["num_key_value_heads"] * 128,
    )
    assert got == 6 * cfg["num_hidden_layers"] * (h * q + 2 * h * kv + q * h)


def test_decoder_sparse_step_and_mlp_only_layers_pick_moe_layers():
    cfg = {
        **llama_config(model_type="qwen3_moe", num_hidden_layers=6),
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 10,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [5],
    }
    out = get_flops_estimator(cfg)([1]).by_component
    moe_layers = 2  # layers 1 and 3 ((i+1) % 2 == 0), layer 5 forced dense
    assert out["routed_experts"] == 6 * moe_layers * 3 * H * 10
    assert out["dense_mlp"] == 6 * (6 - moe_layers) * 3 * H * FFN


def test_gpt_oss_parameter_counts_match_model_card():
    # Model card: 116.83B total, 5.13B active, counting the unembedding but not the embedding.
    counts = get_flops_estimator(load_fixture("gpt-oss-120b")).parameter_counts()
    assert counts.total / 1e9 == pytest.approx(116.83, rel=0.005)
    assert (counts.active - counts.embedding / 2) / 1e9 == pytest.approx(5.13, rel=0.01)
