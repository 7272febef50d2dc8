"""SFT, DPO and GRPO loops (run_algorithm) over the real reference worker on one spawned rank:
one log call per step, the worker's metrics merged once, losses that move as they should."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist import ok_values, run_ranks
from probe import ProbeHooks, portable, to_torch

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

NUM_MOE_LAYERS = 3

SFT_STEPS = 4


def _run_loops(rank, world_size):
    # One intra-op thread per rank: tests/support/dist.py sets OMP_NUM_THREADS after torch is
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
