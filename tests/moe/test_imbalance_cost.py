"""train_perf/expert_imbalance_slowdown: the arithmetic by hand, and a real expert-parallel
run (megatron-core, two gloo ranks) whose logged value equals the hand computation from its
own expert table and the FLOP estimator's components."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.imbalance_cost import (
    busiest_rank_share,
    expert_imbalance_slowdown,
    routed_flops_per_token,
)

# The expert-parallel run builds a megatron-core model: both megatron-core lines.
pytestmark = pytest.mark.megatron

SEQ = 16
MICRO_BATCH = 2


def test_slowdown_by_hand():
    # Layer 0: ranks hold 40 and 20 tokens; layer 1: 4 and 12. Busiest: 40 + 12 of 76.
    counts = np.array([[10, 10, 10, 10, 5, 5, 5, 5], [1, 1, 1, 1, 3, 3, 3, 3]])
    share = busiest_rank_share(counts, 2)
    assert share == pytest.approx(52 / 76)
    # 30% of the step's FLOPs are routed experts: 0.7 + 0.3 * 2 * 52/76.
    assert expert_imbalance_slowdown(0.3, share, 2) == pytest.approx(0.7 + 0.6 * 52 / 76)


def test_one_without_expert_parallelism_or_with_balance():
    counts = np.array([[9, 1, 5, 5]])
    assert expert_imbalance_slowdown(0.5, busiest_rank_share(counts, 1), 1) == 1.0
    balanced = np.array([[3, 7, 6, 4]])  # ranks 10 and 10
    assert expert_imbalance_slowdown(0.5, busiest_rank_share(balanced, 2), 2) == 1.0


def test_uneven_layers_use_each_layers_own_experts():
    # Layer 1 has 4 experts (columns 4.. are no expert): ranks [2+2, 6+0] of it.
    counts = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 6, 0, 0, 0, 0, 0]])
    share = busiest_rank_share(counts, 2, widths=[8, 4])
    assert share == pytest.approx((4 + 6) / (8 + 10))
    assert busiest_rank_share(np.zeros((1, 4)), 2) is None


def test_routed_flops_per_token_is_the_estimators_component():
    from nemo_moe_metrics.flops import get_flops_estimator, load_fixture

    est = get_flops_estimator(load_fixture("qwen3-30b-a3b"))
    per_token = routed_flops_per_token(est)
    assert per_token == pytest.approx(est([4096]).by_component["routed_experts"] / 4096)


def _ep_run(rank, world_size):
    from nemo_moe_metrics.config import MegatronConfig, MetricsConfig, ModelConfig
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    ep = MegatronConfig(expert_model_parallel_size=2)
    init_distributed(ep)
    cfg = ModelConfig(num_layers=2, seq_length=SEQ)
    torch.manual_seed(5)
    model = build_gpt_model(cfg, ep)
    config = build_transformer_config(cfg, ep)
    metrics = PolicyMetrics(
        MetricsConfig(track_moe_metrics=True, track_throughput=True, track_flops=True),
        vocab_size=cfg.vocab_size,
    )
    metrics.attach([model], config)
    gen = torch.Generator().manual_seed(100 + rank)
    mask = causal_attention_mask(SEQ)
    pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    lens = []
    with metrics.step():
        for _ in range(2):
            tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
            with cpu_device_mode():
                model(tokens, pos, mask, labels=tokens).float().mean().backward()
            metrics.microbatch(seq_lens=torch.full((MICRO_BATCH,), SEQ))
            lens += [SEQ] * MICRO_BATCH
    out = metrics.finish_step(num_microbatches=2)
    est = get_flops_estimator(config, vocab_size=cfg.vocab_size)
    parts = est(lens * world_size).by_component  # every rank's sequences (same lengths)
    return {
        "slowdown": out.get(mn.EXPERT_IMBALANCE_SLOWDOWN),
        "table": out[mn.EXPERT_LOADS],
        "flops": out[mn.ESTIMATED_FLOPS],
        "routed": parts["routed_experts"],
        "total": sum(parts.values()),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return ok_values(run_ranks(_ep_run, 2, timeout=180))


@pytest.mark.timeout(240)
def test_logged_slowdown_equals_the_hand_computation_from_table_and_components(two_ranks):
    r0, r1 = two_ranks
    assert r0["slowdown"] == r1["slowdown"]
    assert r0["flops"] == pytest.approx(r0["total"])
    f = r0["routed"] / r0["total"]
    busiest = total = 0
    for layer in sorted({row[0] for row in r0["table"]}):
        row = [n for la, _, n, _ in r0["table"] if la == layer]
        ranks = [sum(row[: len(row) // 2]), sum(row[len(row) // 2 :])]
        busiest += max(ranks)
        total += sum(ranks)
    expected = (1 - f) + f * 2 * busiest / total
    assert r0["slowdown"] == pytest.approx(expected, rel=1e-12)
    assert r0["slowdown"] > 1.0  # random tokens on a random router are not balanced
