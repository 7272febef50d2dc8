"""The reference Megatron policy worker: hook protocol, microbatching, no-grad scoring, and
data/expert-parallel gradients equal to one rank training on the union of both ranks' data.

Two spawns are shared by all tests: expert parallel 2 on 2 gloo ranks, then one rank that
loads the same initial weights (experts gathered from both ranks) and trains on both batches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from dist import ok_values, run_ranks
from probe import ProbeHooks, portable, to_torch

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
SEED = 77
PER_RANK = 8  # sequences per rank in the parallel run
NUM_MOE_LAYERS = 3  # moe_layer_freq [0, 1, 1, 1]
EXPERT_KEY = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def _recipe(ep: int):
    from nemo_moe_metrics.config import load_recipe

    return load_recipe(RECIPE, [f"policy.megatron_cfg.expert_model_parallel_size={ep}"])


def _rank_batch(recipe, rank: int):
    from nemo_moe_metrics.algorithms.data import generator, sft_batch

    m = recipe.policy.model
    return sft_batch(
        PER_RANK,
        m.seq_length,
        recipe.training.min_seq_length,
        m.vocab_size,
        generator(SEED, 0, rank),
    )


def _tensors(state):
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _parallel_step(rank, world_size):
    # One intra-op thread per rank: tests/support/dist.py sets OMP_NUM_THREADS after torch is
    # imported, and two spinning threads per rank on a shared 2-core machine cost 10x.
    torch.set_num_threads(1)
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.algorithms.sft import sft_loss

    recipe = _recipe(2)
    worker = MegatronPolicyWorker(recipe)
    initial = _tensors(worker.model.state_dict())
    result = worker.train(_rank_batch(recipe, worker.dp_rank), sft_loss)
    grads = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
    return portable(
        {"dp_rank": worker.dp_rank, "initial": initial, "grads": grads, "result": result}
    )


def _single_rank(rank, world_size, parallel):
    # One intra-op thread per rank: tests/support/dist.py sets OMP_NUM_THREADS after torch is
    # imported, and two spinning threads per rank on a shared 2-core machine cost 10x.
    torch.set_num_threads(1)
    from nemo_moe_metrics.algorithms.data import SequenceBatch, copy_prompts, generator
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.algorithms.sft import sft_loss

    parallel = to_torch(parallel)
    recipe = _recipe(1)
    probe = ProbeHooks()
    worker = MegatronPolicyWorker(recipe, metrics=probe)
    # The parallel run's initial weights: dense from rank 0, experts gathered (rank r held
    # global experts 4r..4r+3 as local 0..3).
    state = dict(parallel[0]["initial"])
    merged_grads = dict(parallel[0]["grads"])
    for r, out in enumerate(parallel):
        for key_set, target in ((out["initial"], state), (out["grads"], merged_grads)):
            for k, v in key_set.items():
                m = EXPERT_KEY.match(k)
                if m:
                    target[f"{m[1]}{int(m[2]) + 4 * r}{m[3]}"] = v
    missing = worker.model.load_state_dict(state, strict=False)
    assert not [k for k in missing.missing_keys if not k.endswith("_extra_state")], missing

    batches = [_rank_batch(recipe, r) for r in range(2)]
    union = SequenceBatch(
        torch.cat([b.tokens for b in batches]),
        torch.cat([b.lengths for b in batches]),
        torch.cat([b.prompt_lengths for b in batches]),
    )
    pad_check = _aux_losses_ignore_padding_contents(worker, batches[0])
    lp_init = worker.logprobs(batches[0])
    worker.snapshot_reference()
    marks = {"start": (len(probe.calls), len(probe.router_calls))}
    result16 = worker.train(union, sft_loss)
    grads = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
    marks["train16"] = (len(probe.calls), len(probe.router_calls))
    result4 = worker.train(batches[1].slice(0, 4), sft_loss)
    marks["train4"] = (len(probe.calls), len(probe.router_calls))
    lp_current = worker.logprobs(batches[0])
    with worker.reference_weights():
        lp_ref = worker.logprobs(batches[0])
    lp_restored = worker.logprobs(batches[0])
    prompts = copy_prompts(4, 6, recipe.policy.model.vocab_size, generator(SEED, 1, 0))
    sampled = worker.generate(prompts, 5, temperature=1.0, generator=generator(SEED, 2, 0))
    marks["inference"] = (len(probe.calls), len(probe.router_calls))
    try:
        worker.train(batches[0].slice(0, 3), sft_loss)
        bad = None
    except ValueError as err:
        bad = str(err)
    return portable(
        {
            "calls": probe.calls,
            "router_calls": probe.router_calls,
            "marks": marks,
            "union_tokens": union.tokens,
            "batch4_tokens": batches[1].tokens[:4],
            "result16": result16,
            "result4": result4,
            "grads": grads,
            "expected_grads": merged_grads,
            "lp": (lp_init, lp_current, lp_ref, lp_restored),
            "prompts": prompts,
            "sampled": sampled,
            "bad_batch_error": bad,
            "pad_check": pad_check,
        }
    )


def _aux_losses_ignore_padding_contents(worker, batch):
    """Tracker aux losses of one training-mode forward, with padding filled two ways."""
    from nemo_moe_metrics.megatron.compat import clear_tracker, tracker_values

    out = []
    for fill, use_mask in ((3, True), (90, True), (3, False), (90, False)):
        tokens = batch.tokens.clone()
        tokens[batch.padding_mask()] = fill
        clear_tracker()
        worker.model.train()
        worker._forward(worker.model, tokens, batch.padding_mask() if use_mask else None)
        out.append({k: v.clone() for k, v in tracker_values().items()})
    clear_tracker()
    return out


@pytest.fixture(scope="module")
def runs():
    parallel = ok_values(run_ranks(_parallel_step, 2, timeout=180))
    (single,) = ok_values(run_ranks(_single_rank, 1, parallel, timeout=180))
    return to_torch(parallel), to_torch(single)


def _real_tokens(tokens):
    # Independent of the worker: synthetic tokens are 1..V-1, padding is 0.
    return (tokens != 0).sum(dim=1).tolist()


def test_hooks_attach_once_with_model_and_its_transformer_config(runs):
    _, s = runs
    assert s["calls"][0] == ("attach", True, True, 8)
    assert sum(1 for c in s["calls"] if c[0] == "attach") == 1


def test_each_train_call_is_step_microbatches_then_finish_step(runs):
    _, s = runs
    a, b = s["marks"]["start"][0], s["marks"]["train16"][0]
    kinds = [c[0] for c in s["calls"][a:b]]
    assert kinds == ["step_enter"] + ["microbatch"] * 8 + ["step_exit", "finish_step"]
    assert s["calls"][b - 1] == ("finish_step", 8, False)


def test_microbatch_count_follows_batch_size(runs):
    _, s = runs
    b, c = s["marks"]["train16"][0], s["marks"]["train4"][0]
    assert [c_ for c_ in s["calls"][b:c] if c_[0] == "finish_step"] == [("finish_step", 2, False)]
    assert s["result16"]["train/num_microbatches"] == 8
    assert s["result4"]["train/num_microbatches"] == 2


def test_microbatch_seq_lens_are_the_real_tokens_of_each_microbatch(runs):
    _, s = runs
    a, b = s["marks"]["start"][0], s["marks"]["train16"][0]
    mbs = [c for c in s["calls"][a:b] if c[0] == "microbatch"]
    real = _real_tokens(s["union_tokens"])
    assert [c[1] for c in mbs] == [real[i : i + 2] for i in range(0, 16, 2)]
    assert sum(sum(c[1]) for c in mbs) == sum(real) < s["union_tokens"].numel()
    # Called inside the step, with grad enabled, with an integer tensor.
    assert all(c[2] and c[3] and c[4] == "torch.int64" for c in mbs)


def test_training_router_forwards_get_the_padding_mask_true_at_padding(runs):
    _, s = runs
    a, b = s["marks"]["start"][1], s["marks"]["train16"][1]
    calls = s["router_calls"][a:b]
    assert len(calls) == NUM_MOE_LAYERS * 8
    assert all(c["grad"] and c["training"] for c in calls)
    assert sum(c["valid"] for c in calls) == NUM_MOE_LAYERS * sum(_real_tokens(s["union_tokens"]))
    assert sum(c["tokens"] for c in calls) == NUM_MOE_LAYERS * s["union_tokens"].numel()


def test_scoring_and_sampling_run_without_grad_in_eval_and_without_hook_calls(runs):
    _, s = runs
    a, b = s["marks"]["train4"], s["marks"]["inference"]
    assert b[0] == a[0], "no hook method is called for logprobs/generate"
    calls = s["router_calls"][a[1] : b[1]]
    # 3 scoring passes of 8 sequences (4 microbatches) + 5 sampling steps of 2 microbatches.
    assert len(calls) == NUM_MOE_LAYERS * (3 * 4 + 5 * 2)
    assert not any(c["grad"] or c["training"] for c in calls)


def test_train_merges_finish_step_dict_with_keys_unchanged(runs):
    _, s = runs
    assert s["result16"]["moe/probe"] == 1.5
    assert s["result16"]["train_perf/probe"] == 2.5
    assert not any(k.startswith(("train/moe/", "moe/moe/")) for k in s["result16"])


def test_reference_weights_are_the_initial_weights_and_swap_back(runs):
    _, s = runs
    lp_init, lp_current, lp_ref, lp_restored = s["lp"]
    assert not torch.allclose(lp_current, lp_init), "training changed the policy"
    torch.testing.assert_close(lp_ref, lp_init)
    torch.testing.assert_close(lp_restored, lp_current)


def test_generate_keeps_prompts_and_never_samples_padding(runs):
    _, s = runs
    assert s["sampled"].shape == (4, 11)
    assert torch.equal(s["sampled"][:, :6], s["prompts"])
    assert (s["sampled"] != 0).all()


def test_padding_mask_keeps_padding_out_of_router_aux_losses(runs):
    # Megatron's padding_mask is True at padding: with it, what the padding holds cannot
    # change the aux losses; without it, it does (so the check has teeth).
    masked_a, masked_b, plain_a, plain_b = runs[1]["pad_check"]
    assert set(masked_a) >= {"load_balancing_loss", "z_loss"}
    for name in ("load_balancing_loss", "z_loss"):
        torch.testing.assert_close(masked_a[name], masked_b[name])
        assert not torch.allclose(plain_a[name], plain_b[name]), name


def test_bad_batch_size_names_micro_batch_size(runs):
    _, s = runs
    assert s["bad_batch_error"] is not None
    assert "train_micro_batch_size=2" in s["bad_batch_error"]


def test_expert_parallel_gradients_equal_one_rank_on_the_union_batch(runs):
    parallel, s = runs
    assert [p["dp_rank"] for p in parallel] == [0, 1]
    for name, expected in s["expected_grads"].items():
        torch.testing.assert_close(s["grads"][name], expected, rtol=1e-4, atol=1e-6, msg=name)
    # Dense gradients are identical on both ranks after the data-parallel all-reduce.
    for name, g in parallel[0]["grads"].items():
        if not EXPERT_KEY.match(name):
            torch.testing.assert_close(parallel[1]["grads"][name], g, rtol=0, atol=0)


def test_logged_loss_is_the_data_parallel_mean(runs):
    parallel, s = runs
    assert parallel[0]["result"]["train/loss"] == parallel[1]["result"]["train/loss"]
    assert parallel[0]["result"]["train/loss"] == pytest.approx(
        s["result16"]["train/loss"], rel=1e-5
    )


def test_pipeline_parallel_is_rejected_before_any_process_group():
    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(RECIPE, ["policy.megatron_cfg.pipeline_model_parallel_size=2"])
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1"):
        MegatronPolicyWorker(recipe)
