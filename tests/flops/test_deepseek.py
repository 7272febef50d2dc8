"""DeepSeek (flops/deepseek.py): the first dense layers and the shared experts."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    get_flops_estimator,
    load_fixture,
)

pytestmark = pytest.mark.megatron


def test_deepseek_first_k_dense_and_shared_experts():
    cfg = load_fixture("deepseek-v3")
    out = get_flops_estimator(cfg)([1]).by_component
    h, w = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert out["dense_mlp"] == 6 * 3 * 3 * h * cfg["intermediate_size"]
    assert out["shared_experts"] == 6 * 58 * 3 * h * w
    assert out["routed_experts"] == 6 * 58 * 8 * 3 * h * w
