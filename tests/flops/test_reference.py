"""The reference formulas docs/en/flops.md compares with (flops/reference.py)."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    get_flops_estimator,
    load_fixture,
)

pytestmark = pytest.mark.megatron


# --- reference formulas used in docs/en/flops.md ------------------------------------------


def test_torchtitan_style_equals_our_unmasked_count_on_a_dense_model():
    from nemo_moe_metrics.flops.reference import torchtitan_style_flops

    est = get_flops_estimator(load_fixture("llama-3.1-8b"))
    for t in (4096, 32768):
        assert torchtitan_style_flops(est, t) == pytest.approx(
            est([t], causal=False).total, rel=1e-12
        )


def test_megatron_style_differs_from_ours_by_the_diagonal_only_on_a_dense_model():
    from nemo_moe_metrics.flops.reference import megatron_style_flops

    cfg = load_fixture("llama-3.1-8b")
    est = get_flops_estimator(cfg)
    t = 4096
    # T(T+1)/2 attended pairs vs T^2/2: the T/2 diagonal pairs per layer.
    width = cfg["num_attention_heads"] * 2 * 128
    diagonal = 3 * 2 * cfg["num_hidden_layers"] * width * t / 2
    assert est([t]).total - megatron_style_flops(est, t) == pytest.approx(diagonal, rel=1e-9)
