"""SFT, DPO and GRPO loops over the real worker (one spawned rank), and their pure parts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist import ok_values, run_ranks
from probe import ProbeHooks, portable, to_torch

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
NUM_MOE_LAYERS = 3
SFT_STEPS = 4


def _run_loops(rank, world_size):
    # One intra-op thread per rank: tests/dist.py sets OMP_NUM_THREADS after torch is
    # imported, and two spinning threads per rank on a shared 2-core machine cost 10x.
    torch.set_num_threads(1)
    from nemo_moe_metrics.algorithms import run_algorithm
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.config import load_recipe

    out = {}
    for algo, steps in (("sft", SFT_STEPS), ("dpo", 2), ("grpo", 2)):
        # One rank: the global batch of 8 is this rank's whole batch.
        recipe = load_recipe(
            CONFIGS / f"{algo}_moe_tiny.yaml",
            [
                "policy.megatron_cfg.expert_model_parallel_size=1",
                "policy.train_global_batch_size=8",
                f"training.max_steps={steps}",
            ],
        )
        probe = ProbeHooks()
        worker = MegatronPolicyWorker(recipe, metrics=probe)
        logged = []
        run_algorithm(
            recipe, worker, lambda metrics, step, logged=logged: logged.append((step, metrics))
        )
        out[algo] = {"logged": logged, "calls": probe.calls, "router_calls": probe.router_calls}
    return portable(out)


@pytest.fixture(scope="module")
def loops():
    (out,) = ok_values(run_ranks(_run_loops, 1, timeout=240))
    return to_torch(out)


@pytest.mark.parametrize("algo,steps", [("sft", SFT_STEPS), ("dpo", 2), ("grpo", 2)])
def test_log_fn_called_once_per_step_with_finite_loss(loops, algo, steps):
    logged = loops[algo]["logged"]
    assert [s for s, _ in logged] == list(range(steps))
    assert all(math.isfinite(m["train/loss"]) for _, m in logged)


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo"])
def test_worker_metrics_merged_once_with_keys_unchanged(loops, algo):
    for _, metrics in loops[algo]["logged"]:
        assert metrics["moe/probe"] == 1.5
        assert metrics["train_perf/probe"] == 2.5
        assert not [k for k in metrics if k.count("moe/") > 1 or k.count("train_perf/") > 1]
        assert not [k for k in metrics if k.startswith("train/") and "probe" in k]


def test_sft_loss_decreases(loops):
    losses = [m["train/loss"] for _, m in loops["sft"]["logged"]]
    assert losses[-1] < losses[0], losses
    # Starts near uniform over the vocabulary: ln(128) = 4.85.
    assert abs(losses[0] - math.log(128)) < 0.5


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo"])
def test_microbatches_per_step_are_batch_over_micro_batch(loops, algo):
    finishes = [c for c in loops[algo]["calls"] if c[0] == "finish_step"]
    # train_global_batch_size 8 on one rank, train_micro_batch_size 2.
    assert [c[1] for c in finishes] == [8 // 2] * len(loops[algo]["logged"])
    assert all(m["train/num_microbatches"] == 4 for _, m in loops[algo]["logged"])
    assert all(m["train/num_sequences"] == 8 for _, m in loops[algo]["logged"])


def _grad_split(router_calls):
    with_grad = [c for c in router_calls if c["grad"]]
    without = [c for c in router_calls if not c["grad"]]
    return with_grad, without


def test_dpo_reference_forwards_run_without_grad_in_eval(loops):
    with_grad, without = _grad_split(loops["dpo"]["router_calls"])
    steps, mbs = 2, 4
    assert len(with_grad) == NUM_MOE_LAYERS * mbs * steps  # training only
    assert all(c["training"] for c in with_grad)
    assert len(without) == NUM_MOE_LAYERS * mbs * steps  # one reference pass per step
    assert not any(c["training"] for c in without)
    assert sum(1 for c in loops["dpo"]["calls"] if c[0] == "microbatch") == mbs * steps


def test_grpo_rollouts_and_scoring_run_without_grad_in_eval(loops):
    with_grad, without = _grad_split(loops["grpo"]["router_calls"])
    steps, mbs, response_length = 2, 4, 8
    assert len(with_grad) == NUM_MOE_LAYERS * mbs * steps
    # Per step: one forward per sampled token over 4 microbatches, then one scoring pass.
    assert len(without) == NUM_MOE_LAYERS * steps * (response_length * mbs + mbs)
    assert not any(c["training"] for c in without)


def test_grpo_logs_reward_in_unit_interval(loops):
    for _, m in loops["grpo"]["logged"]:
        assert 0.0 <= m["train/reward"] <= 1.0
        assert m["train/reward_std"] >= 0.0


def test_dpo_starts_at_log_two(loops):
    # Policy == reference at step 0, so every implicit reward is 0 and the loss is ln 2.
    first = loops["dpo"]["logged"][0][1]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["train/chosen_reward"] == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- pure parts, no ranks


def test_sft_batches_are_deterministic_and_differ_across_ranks():
    from nemo_moe_metrics.algorithms.data import generator, sft_batch

    a = sft_batch(8, 32, 12, 128, generator(5, 3, 0))
    again = sft_batch(8, 32, 12, 128, generator(5, 3, 0))
    other_rank = sft_batch(8, 32, 12, 128, generator(5, 3, 1))
    other_step = sft_batch(8, 32, 12, 128, generator(5, 4, 0))
    assert torch.equal(a.tokens, again.tokens)
    assert not torch.equal(a.tokens, other_rank.tokens)
    assert not torch.equal(a.tokens, other_step.tokens)


def test_sft_batch_is_right_padded_progressions():
    from nemo_moe_metrics.algorithms.data import generator, sft_batch

    b = sft_batch(16, 32, 12, 128, generator(1, 0, 0))
    for row, n in zip(b.tokens, b.lengths.tolist(), strict=True):
        assert 12 <= n <= 32
        assert (row[n:] == 0).all() and (row[:n] > 0).all()
        diffs = {int((row[i + 1] - row[i]) % 127) for i in range(n - 1)}
        assert len(diffs) == 1 and diffs <= {1, 2, 3}


def test_masks_on_a_hand_made_batch():
    from nemo_moe_metrics.algorithms.data import SequenceBatch

    b = SequenceBatch(
        torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]]), torch.tensor([3, 4]), torch.tensor([1, 2])
    )
    assert b.padding_mask().tolist() == [[False, False, False, True], [False] * 4]
    # Position t predicts token t+1; trained when prompt_len <= t+1 < length.
    assert b.target_mask().tolist() == [[True, True, False], [False, True, True]]


def test_sequence_batch_rejects_lengths_beyond_the_padded_width():
    from nemo_moe_metrics.algorithms.data import SequenceBatch

    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 4\]"):
        SequenceBatch(torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 5]), torch.zeros(2))


def test_dpo_pairs_share_prompt_and_differ_in_response():
    from nemo_moe_metrics.algorithms.data import dpo_batch, generator

    b = dpo_batch(4, 32, 12, 8, 128, generator(2, 0, 0))
    for i in range(0, 8, 2):
        p, n = int(b.prompt_lengths[i]), int(b.lengths[i])
        assert b.prompt_lengths[i + 1] == p and b.lengths[i + 1] == n == p + 8
        assert torch.equal(b.tokens[i, :p], b.tokens[i + 1, :p])
        assert not torch.equal(b.tokens[i, p:n], b.tokens[i + 1, p:n])


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


def test_merge_rejects_a_key_clash():
    from nemo_moe_metrics.algorithms.common import merge_step_metrics

    merged = merge_step_metrics({"train/reward": 1.0}, {"moe/x": 2.0})
    assert merged == {"train/reward": 1.0, "moe/x": 2.0}
    with pytest.raises(ValueError, match="train/loss"):
        merge_step_metrics({"train/loss": 1.0}, {"train/loss": 2.0})


def test_dpo_rejects_odd_micro_batch_before_training():
    from nemo_moe_metrics.algorithms.dpo import run_dpo
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(
        CONFIGS / "dpo_moe_tiny.yaml",
        ["policy.train_micro_batch_size=1", "policy.train_global_batch_size=8"],
    )
    with pytest.raises(ValueError, match="must both be even"):
        run_dpo(recipe, worker=None, log_fn=print)


def test_grpo_rejects_partial_groups_before_sampling():
    from nemo_moe_metrics.algorithms.grpo import run_grpo
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(
        CONFIGS / "grpo_moe_tiny.yaml",
        ["policy.train_global_batch_size=6", "grpo.num_generations=4"],
    )
    with pytest.raises(ValueError, match="multiple of grpo.num_generations=4"):
        run_grpo(recipe, worker=None, log_fn=print)
