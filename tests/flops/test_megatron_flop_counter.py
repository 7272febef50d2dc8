"""The TransformerConfig estimator agrees with FlopCounterMode on a real megatron-core GPTModel.

This is the estimator the training worker uses for the recipe model, so it is checked on the
model megatron-core actually builds (CPU, one gloo rank), forward + backward, including a
packed batch, and on a variant with shared experts, kv_channels != hidden/heads and another
MoE layer pattern.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
ONE_RANK = "policy.megatron_cfg.expert_model_parallel_size=1"
LENGTHS = ([16], [5, 11, 9])
VARIANT = [
    "policy.model.kv_channels=24",
    "policy.model.num_query_groups=1",
    "policy.model.moe_shared_expert_intermediate_size=48",
    "policy.model.moe_layer_freq=[1,0,1,0]",
]


def _count_and_estimate(rank, world_size):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        causal_attention_mask,
        init_distributed,
    )

    results = {}
    for name, overrides in (("recipe", []), ("variant", VARIANT)):
        recipe = load_recipe(RECIPE, [ONE_RANK, *overrides])
        model_cfg, megatron_cfg = recipe.policy.model, recipe.policy.megatron_cfg
        init_distributed(megatron_cfg)
        torch.manual_seed(0)
        model = build_gpt_model(model_cfg, megatron_cfg)
        est = get_flops_estimator(
            build_transformer_config(model_cfg, megatron_cfg), vocab_size=model_cfg.vocab_size
        )
        for lengths in LENGTHS:
            counter = FlopCounterMode(display=False)
            with counter:
                for n in lengths:
                    tokens = torch.randint(0, model_cfg.vocab_size, (1, n))
                    positions = torch.arange(n).unsqueeze(0)
                    loss = model(tokens, positions, causal_attention_mask(n), labels=tokens)
                    loss.sum().backward()
            model.zero_grad(set_to_none=True)
            estimate = est(lengths, causal=False)
            results[(name, tuple(lengths))] = (
                float(counter.get_total_flops()),
                estimate.total,
                dict(estimate.by_component),
            )
    return results


@pytest.fixture(scope="module")
def megatron_counts():
    (result,) = ok_values(run_ranks(_count_and_estimate, 1, timeout=240))
    return result


@pytest.mark.timeout(300)
def test_recipe_model_estimate_matches_flop_counter(megatron_counts):
    for lengths in LENGTHS:
        counted, estimated, _ = megatron_counts[("recipe", tuple(lengths))]
        assert estimated == pytest.approx(counted, rel=0.005), lengths


@pytest.mark.timeout(300)
def test_shared_experts_and_kv_channels_variant_matches_flop_counter(megatron_counts):
    for lengths in LENGTHS:
        counted, estimated, components = megatron_counts[("variant", tuple(lengths))]
        assert components["shared_experts"] > 0
        assert estimated == pytest.approx(counted, rel=0.005), lengths
