"""Qwen3-Next (flops/qwen_hybrid.py): its components follow the architecture, its parameter
count the published one."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    get_flops_estimator,
    load_fixture,
)

pytestmark = pytest.mark.megatron


def test_component_keys_follow_the_architecture():
    keys = set(get_flops_estimator(load_fixture("qwen3-next-80b-a3b"))([8]).by_component)
    assert keys == {
        "attention_projections",
        "attention_core",
        "linear_attention_projections",
        "linear_attention_conv",
        "linear_attention_core",
        "router",
        "routed_experts",
        "shared_experts",
        "lm_head",
    }
    dense = set(get_flops_estimator(load_fixture("llama-3.1-8b"))([8]).by_component)
    assert dense == {"attention_projections", "attention_core", "dense_mlp", "lm_head"}


def test_qwen3_next_parameter_counts_match_published():
    counts = get_flops_estimator(load_fixture("qwen3-next-80b-a3b")).parameter_counts()
    assert counts.total / 1e9 == pytest.approx(80.0, rel=0.01)
    # "A3B": about 3B active outside the embedding tables.
    assert 3.0 < (counts.active - counts.embedding) / 1e9 < 3.5
