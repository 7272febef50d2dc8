"""The tiny recipe model is a real megatron-core GPTModel that trains on CPU, alone and with
EP=2."""

from pathlib import Path

import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"


def _forward_backward(rank, world_size, ep_size):
    import torch

    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        causal_attention_mask,
        init_distributed,
    )

    recipe = load_recipe(RECIPE, [f"policy.megatron_cfg.expert_model_parallel_size={ep_size}"])
    model_cfg = recipe.policy.model
    init_distributed(recipe.policy.megatron_cfg)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    model = build_gpt_model(model_cfg, recipe.policy.megatron_cfg)
    s = model_cfg.seq_length
    torch.manual_seed(100 + rank)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, s))
    position_ids = torch.arange(s).expand(2, s)
    loss = model(tokens, position_ids, causal_attention_mask(s), labels=tokens).mean()
    loss.backward()
    from nemo_moe_metrics.megatron.compat import tracker_values

    tracker = tracker_values()
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    return {
        "loss": float(loss),
        "tracker": {k: v.tolist() for k, v in tracker.items()},
        "routers": [m.layer_number for m in model.modules() if isinstance(m, TopKRouter)],
        "local_experts": [m.num_local_experts for m in moe_layers],
        "router_grad": all(
            m.weight.grad is not None and m.weight.grad.abs().sum() > 0
            for m in model.modules()
            if isinstance(m, TopKRouter)
        ),
    }


def _check(result, model_layers=4, moe_layers=(2, 3, 4)):
    assert result["loss"] > 0
    assert result["router_grad"]
    assert result["routers"] == list(moe_layers)
    for name in ("load_balancing_loss", "z_loss"):
        values = result["tracker"][name]
        assert len(values) == model_layers
        assert values[0] == 0.0, "dense first layer records no aux loss"
        # The switch balance loss is about 1 at init; z-loss is positive.
        assert all(v > 0 for v in values[1:]), (name, values)


@pytest.mark.timeout(180)
def test_tiny_moe_model_trains_on_cpu_and_fills_tracker():
    (result,) = ok_values(run_ranks(_forward_backward, 1, 1))
    _check(result)
    assert result["local_experts"] == [8, 8, 8]


@pytest.mark.timeout(240)
def test_expert_parallel_two_gloo_ranks():
    results = ok_values(run_ranks(_forward_backward, 2, 2))
    for result in results:
        _check(result)
        assert result["local_experts"] == [4, 4, 4]
    # Ranks saw different tokens, so their losses differ: real data parallelism.
    assert results[0]["loss"] != results[1]["loss"]
