"""Unequal microbatch counts across data-parallel ranks: which mean the aux loss reports.

Two real gloo ranks, data parallel 2, the tiny megatron-core model through megatron-core's own
schedule: rank 0 runs one microbatch, rank 1 runs three. docs/en/aux_loss.md states the
weighting (the unweighted mean of the two ranks' per-microbatch means, which is the aux-loss
term megatron's gradients follow); this checks it against values recomputed from the routers'
captured inputs, and that a per-microbatch weighting would give a different number here.
Also the fact the docs state about gloo: ``ReduceOp.AVG`` works.
"""

from __future__ import annotations

import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export.metric_names import aux_loss_key
from tests.moe.test_aux_loss import capture_routers, load_balancing_loss_of, run_schedule

pytestmark = pytest.mark.megatron

MICROBATCHES = (1, 3)  # per data-parallel rank


def _unequal_microbatches(rank, world_size):
    import torch.distributed as dist

    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    parallel = MegatronConfig()  # data parallel 2: no collective inside a forward
    init_distributed(parallel)
    avg = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)

    cfg = ModelConfig(num_layers=2)
    torch.manual_seed(5)  # identical weights on both ranks, as in real data parallel
    model = build_gpt_model(cfg, parallel)
    calls: list = []
    capture_routers(model, calls)
    n = MICROBATCHES[rank]
    run_schedule(model, cfg, n, seed=300 + rank)
    metrics = aux_loss_metrics(
        build_transformer_config(cfg, parallel), num_microbatches=n, per_layer=False
    )
    return dict(avg=avg.tolist(), calls=calls, metrics=metrics)


@pytest.fixture(scope="module")
def two_ranks():
    return ok_values(run_ranks(_unequal_microbatches, 2, timeout=150))


def _losses(result) -> dict[int, list[float]]:
    """Per layer, the load-balancing loss of each recorded microbatch of one rank."""
    out: dict[int, list[float]] = {}
    for call in result["calls"]:
        if call["recorded"]:
            out.setdefault(call["layer"], []).append(load_balancing_loss_of(call))
    return out


@pytest.mark.timeout(220)
def test_gloo_all_reduce_avg_averages(two_ranks):
    for result in two_ranks:
        assert result["avg"] == [1.5, 15.0]


@pytest.mark.timeout(220)
def test_unequal_microbatch_counts_report_the_mean_of_per_rank_means(two_ranks):
    per_rank = [_losses(r) for r in two_ranks]
    assert [len(p[0]) for p in per_rank] == list(MICROBATCHES)
    layers = sorted(per_rank[0])
    rank_means = [sum(sum(p[i]) / len(p[i]) for i in layers) / len(layers) for p in per_rank]
    expected = sum(rank_means) / 2
    per_microbatch = sum(sum(sum(p[i]) for p in per_rank) / sum(MICROBATCHES) for i in layers)
    per_microbatch /= len(layers)
    assert abs(expected - per_microbatch) > 1e-5  # the two weightings differ on this data
    for result in two_ranks:
        got = result["metrics"][aux_loss_key("load_balancing_loss")]
        assert got == pytest.approx(expected, rel=1e-6, abs=0)
        assert got != pytest.approx(per_microbatch, rel=1e-6, abs=0)
    print(f"mean of per-rank means {expected:.6f}, per-microbatch weighting {per_microbatch:.6f}")
