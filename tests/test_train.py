"""PolicyMetrics, the policy-worker integration, on the real reference worker and model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from dist import ok_values, run_ranks

from nemo_moe_metrics.export import metric_names as names

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
SFT = CONFIGS / "sft_moe_tiny.yaml"


def _train_flags_off(rank, world_size, out_dir):
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import make_metrics
    from nemo_moe_metrics.train import train

    off = [
        f"policy.megatron_cfg.{flag}=false"
        for flag in ("track_moe_metrics", "track_throughput", "track_flops")
    ]
    recipe = load_recipe(
        SFT,
        [
            "policy.megatron_cfg.expert_model_parallel_size=1",
            "training.max_steps=1",
            "logger.tensorboard_enabled=false",
            "logger.wandb_enabled=false",
            *off,
        ],
    )
    assert make_metrics(recipe) is None
    train(recipe, out_dir)
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_flags_off_emit_no_metric_keys(tmp_path):
    (rows,) = ok_values(run_ranks(_train_flags_off, 1, str(tmp_path)))
    assert len(rows) == 1 and "train/loss" in rows[0]
    assert not [k for k in rows[0] if k.startswith((names.MOE_PREFIX, names.PERF_PREFIX))]


def _worker_scenarios(rank, world_size):
    import torch

    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.algorithms.sft import sft_loss
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import make_metrics

    recipe = load_recipe(SFT, ["policy.megatron_cfg.moe_per_layer_logging=true"])
    hooks = make_metrics(recipe)
    worker = MegatronPolicyWorker(recipe, metrics=hooks)
    from nemo_moe_metrics.algorithms.data import sft_batch

    generator = torch.Generator().manual_seed(7 + rank)
    model = recipe.policy.model

    def batch():
        return sft_batch(
            recipe.policy.train_global_batch_size // worker.dp_size,
            model.seq_length,
            recipe.training.min_seq_length,
            model.vocab_size,
            generator,
        )

    good = worker.train(batch(), sft_loss)

    # A step that raises halfway (after some microbatches ran) leaves nothing behind.
    calls = {"n": 0}

    def failing_loss(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return sft_loss(*args)

    with pytest.raises(RuntimeError, match="boom"):
        worker.train(batch(), failing_loss)
    torch.distributed.barrier()
    after = worker.train(batch(), sft_loss)
    return {"good": good, "after": after}


@pytest.mark.timeout(240)
def test_two_ranks_get_identical_metrics_and_failed_step_leaves_no_counts():
    results = ok_values(run_ranks(_worker_scenarios, 2, timeout=200))
    moe_or_perf = [
        {k: v for k, v in r["after"].items() if k.startswith(("moe/", "train_perf/"))}
        for r in results
    ]
    # Identical on every rank, timing included (seconds are the max over ranks).
    assert moe_or_perf[0] == moe_or_perf[1]
    for r in results:
        for step in ("good", "after"):
            metrics = r[step]
            per_layer: dict[int, int] = {}
            for layer, _e, tokens, _p in metrics[names.EXPERT_LOADS]:
                per_layer[layer] = per_layer.get(layer, 0) + tokens
            # Counts of exactly this step's training tokens: the failed step's partial
            # microbatches were discarded, not carried into the next step.
            assert set(per_layer.values()) == {metrics[names.TOKENS] * 2}, (step, per_layer)
        # Two steps exported so far: the failed one is in neither interval nor total.
        after = r["after"]
        assert after[names.TOTAL_TOKENS] == r["good"][names.TOKENS] + after[names.TOKENS]
        assert after[names.aux_loss_layer_key("load_balancing_loss", 1)] > 0


def _dense_model_with_moe_flag(rank, world_size):
    import torch

    from nemo_moe_metrics.algorithms.megatron_policy import MegatronPolicyWorker
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.launch.recipe_run import make_metrics

    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("nemo_moe_metrics").addHandler(Capture())
    recipe = load_recipe(
        SFT,
        [
            "policy.megatron_cfg.expert_model_parallel_size=1",
            "policy.model.num_experts=null",
            "policy.model.moe_layer_freq=1",
        ],
    )
    hooks = make_metrics(recipe)
    worker = MegatronPolicyWorker(recipe, metrics=hooks)
    forward_hooks = sum(len(m._forward_hooks) for m in worker.model.modules())
    from nemo_moe_metrics.algorithms.data import sft_batch
    from nemo_moe_metrics.algorithms.sft import sft_loss

    model = recipe.policy.model
    g = torch.Generator().manual_seed(0)
    batch = sft_batch(8, model.seq_length, recipe.training.min_seq_length, model.vocab_size, g)
    metrics = worker.train(batch, sft_loss)
    return {"records": records, "forward_hooks": forward_hooks, "keys": sorted(metrics)}


@pytest.mark.timeout(180)
def test_dense_model_with_moe_flag_gets_a_notice_and_no_hooks():
    ((out),) = ok_values(run_ranks(_dense_model_with_moe_flag, 1))
    notices = [r for r in out["records"] if "no MoE layers" in r]
    assert len(notices) == 1
    assert out["forward_hooks"] == 0
    assert not [k for k in out["keys"] if k.startswith("moe/")]
    assert names.TOKENS in out["keys"]  # throughput still measured
