"""The GRPO loop with the R3 recipe on a real megatron-core model (one spawned rank, CPU).

The rollout runs in bf16 autocast and returns its routes; with megatron-core's RouterReplay on,
the training forwards execute exactly those experts (mismatch 0) while the routers' own choice
still disagrees; with replay off by override the replay key is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_moe_r3_tiny.yaml"
LAYERS = (1, 2, 3)


def _loop(rank, world_size):
    import torch

    torch.set_num_threads(1)
    from nemo_moe_metrics.algorithms import run_algorithm
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import make_metrics

    out = {}
    for replay in (True, False):
        recipe = load_recipe(
            RECIPE,
            [
                "policy.megatron_cfg.expert_model_parallel_size=1",
                "training.max_steps=3",
                f"policy.megatron_cfg.moe_enable_routing_replay={str(replay).lower()}",
            ],
        )
        worker = MegatronPolicyWorker(recipe, hooks=make_metrics(recipe))
        logged = []
        run_algorithm(recipe, worker, lambda m, step, logged=logged: logged.append(m))
        out[replay] = [{k: v for k, v in m.items() if "routing" in k} for m in logged]
    return out


@pytest.fixture(scope="module")
def r3_runs():
    (out,) = ok_values(run_ranks(_loop, 1, timeout=300))
    return out


def test_replay_executes_the_rollouts_experts_in_the_grpo_loop_megatron(r3_runs):
    steps = r3_runs[True]
    # bf16 rollout vs the fp32 router's own choice (from its scores, replay notwithstanding).
    assert max(m["moe/routing_disagreement"] for m in steps) > 0, steps
    for m in steps:
        assert m["moe/routing_replay_mismatch"] == 0.0
        assert 0 <= m["moe/routing_disagreement"] < 1
        assert m["moe/routing_topk_overlap"] >= 1 - m["moe/routing_disagreement"]
        # Padding carries -1 (the copy task's sequences are 16 of 32 positions).
        assert m["moe/routing_missing_fraction"] == 0.0
        assert {f"moe/layer_{i}/routing_disagreement" for i in LAYERS} <= set(m)


def test_without_replay_disagreement_is_positive_and_replay_key_absent_megatron(r3_runs):
    steps = r3_runs[False]
    # A few percent of pairs flip between bf16 and fp32 on this tiny model; some step shows it.
    assert max(m["moe/routing_disagreement"] for m in steps) > 0, steps
    for m in steps:
        assert "moe/routing_replay_mismatch" not in m
        assert m["moe/routing_tokens_any_layer_differs"] >= m["moe/routing_disagreement"]
