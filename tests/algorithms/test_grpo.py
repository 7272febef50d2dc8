"""GRPO's pure parts (algorithms/grpo.py): the copy task's reward, advantages within each group,
partial groups refused before sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_copy_reward_exact_parity_and_wrong():
    from nemo_moe_metrics.algorithms.data import copy_reward

    prompts = torch.tensor([[4, 5, 6, 7]])
    # exact, same parity, different parity, exact -> (1 + 0.5 + 0 + 1) / 4
    assert copy_reward(prompts, torch.tensor([[4, 7, 9, 7]])).tolist() == [0.625]
    assert copy_reward(prompts, prompts).tolist() == [1.0]


def test_group_advantages_normalise_within_each_group():
    from nemo_moe_metrics.algorithms.grpo import group_advantages

    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0])
    adv = group_advantages(r, 4)
    first = (r[:4] - 2.5) / (torch.tensor([1.0, 2.0, 3.0, 4.0]).std() + 1e-6)
    torch.testing.assert_close(adv[:4], first)
    assert adv[4:].abs().max() == 0  # a group with equal rewards teaches nothing
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_grpo_rejects_partial_groups_before_sampling():
    from nemo_moe_metrics.algorithms.grpo import run_grpo
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(
        CONFIGS / "grpo_moe_tiny.yaml",
        ["policy.train_global_batch_size=6", "grpo.num_generations=4"],
    )
    with pytest.raises(ValueError, match="multiple of grpo.num_generations=4"):
        run_grpo(recipe, worker=None, log_fn=print)
