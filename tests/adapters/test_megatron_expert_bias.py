"""Aux-loss-free balancing metrics on a real megatron-core GPTModel (CPU, gloo, one rank).

The routers keep ``expert_bias`` (``moe_router_enable_expert_bias``); megatron's own
``_update_router_expert_bias`` (what ``finalize_model_grads`` calls) moves it after each step.
Expected values come from the buffers read directly in the child, computed here in numpy.
"""

from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
STEPS = 3


def _bias_run(rank, world_size):
    import torch

    import nemo_moe_metrics.megatron.model as mm
    from nemo_moe_metrics.config import MetricsConfig, load_recipe
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    recipe = load_recipe(
        RECIPE,
        [
            "policy.megatron_cfg.expert_model_parallel_size=1",
            "policy.model.moe_router_enable_expert_bias=true",
            "policy.model.moe_router_bias_update_rate=0.01",
        ],
    )
    mm.init_distributed(recipe.policy.megatron_cfg)
    model = mm.build_gpt_model(recipe.policy.model, recipe.policy.megatron_cfg)
    config = model.config
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    routers = {
        int(m.layer_number) - 1: m
        for m in model.modules()
        if getattr(m, "expert_bias", None) is not None
    }
    cfg = MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True)
    metrics = PolicyMetrics(cfg)
    metrics.attach(model, config)
    s, out = recipe.policy.model.seq_length, {"bias": [], "metrics": []}
    out["bias"].append({k: r.expert_bias.tolist() for k, r in routers.items()})
    for step in range(STEPS):
        with metrics.step():
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, recipe.policy.model.vocab_size, (2, s), generator=g)
            pos = torch.arange(s).expand(2, s)
            loss = model(tokens, pos, mm.causal_attention_mask(s), labels=tokens).mean()
            loss.backward()
            _update_router_expert_bias([model], config)  # megatron's own bias update
        out["bias"].append({k: r.expert_bias.tolist() for k, r in routers.items()})
        out["metrics"].append(metrics.finish_step(num_microbatches=1))
    return out


@pytest.fixture(scope="module")
def run():
    (result,) = ok_values(run_ranks(_bias_run, 1, timeout=150))
    return result


def test_megatron_bias_range_equals_the_buffers_max_minus_min(run):
    for step, m in enumerate(run["metrics"]):
        bias = run["bias"][step + 1]
        assert sorted(bias) == [1, 2, 3]  # moe_layer_freq [0, 1, 1, 1]
        ranges = {k: float(np.ptp(np.asarray(v))) for k, v in bias.items()}
        for layer, value in ranges.items():
            assert m[f"moe/layer_{layer}/expert_bias_range"] == pytest.approx(value, abs=1e-7)
        assert m["moe/expert_bias_range"] == pytest.approx(np.mean(list(ranges.values())))
    assert run["metrics"][-1]["moe/expert_bias_range"] > 0  # the bias really moved


def test_megatron_bias_update_is_the_mean_abs_change_since_the_last_export(run):
    for step, m in enumerate(run["metrics"]):
        before, after = run["bias"][step], run["bias"][step + 1]
        updates = {
            k: float(np.abs(np.asarray(after[k]) - np.asarray(before[k])).mean()) for k in after
        }
        for layer, value in updates.items():
            assert m[f"moe/layer_{layer}/expert_bias_update"] == pytest.approx(value, abs=1e-7)
            assert value > 0  # sign updates: every expert moves by the update rate
        assert m["moe/expert_bias_update"] == pytest.approx(np.mean(list(updates.values())))


def test_megatron_bias_keys_sit_next_to_the_load_keys(run):
    m = run["metrics"][0]
    assert "moe/max_over_ideal" in m and "moe/expert_bias_range" in m
    assert "moe/layer_0/expert_bias_range" not in m  # the dense first layer has no router
