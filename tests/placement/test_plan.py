"""Placement plans (placement/plan.py): GPU loads of a replicated expert by hand, sweeps monotone
and never below EPLB, extended placements that move no token."""

import numpy as np
import pytest

from nemo_moe_metrics.placement.eplb import (
    rebalance_experts,
)


def test_gpu_loads_split_a_replicated_expert_evenly_by_hand():
    from nemo_moe_metrics.placement.plan import balancedness, gpu_loads

    # Experts [6, 2, 2, 2] on 2 GPUs, slots [0, 1, 0 | 2, 3, 0]: expert 0 has 3 replicas
    # (2 tokens each): GPU 0 = 2 + 2 + 2 = 6, GPU 1 = 2 + 2 + 2 = 6.
    loads = gpu_loads(np.array([[6, 2, 2, 2]]), np.array([[0, 1, 0, 2, 3, 0]]), 2)
    assert loads.tolist() == [[6.0, 6.0]]
    # Contiguous [0, 1 | 2, 3]: 8 and 4, balancedness 6 / 8.
    assert balancedness(gpu_loads(np.array([[6, 2, 2, 2]]), np.array([[0, 1, 2, 3]]), 2)) == [0.75]


def test_sweep_is_monotone_in_r_and_never_below_eplb():
    from nemo_moe_metrics.placement.plan import balancedness, gpu_loads, sweep

    rng = np.random.default_rng(7)
    for experts, gpus in [(64, 8), (32, 16), (128, 16)]:
        weight = (rng.pareto(0.8, size=(12, experts)) * 100).astype(np.int64)
        rows = sweep(weight, ep_size=gpus)
        assert [r.redundant_experts for r in rows] == list(range(0, experts + 1, gpus))
        table = np.stack([r.balancedness for r in rows])
        assert (np.diff(table, axis=0) >= 0).all()
        for row in rows:
            eplb = rebalance_experts(weight, experts + row.redundant_experts, 1, 1, gpus)
            ref = balancedness(gpu_loads(weight, eplb.physical_to_logical, gpus))
            assert (row.balancedness >= ref).all()


@pytest.mark.parametrize(
    "p2l,expected",
    [
        # Experts 1 and 2 wholly on GPUs 0 and 1: another copy of each, where it is.
        ([[0, 1, 0, 2]], [[0, 1, 1, 0, 2, 2]]),
        # Both experts have one copy on each GPU: one more copy of expert 0 on each.
        ([[0, 1, 0, 1]], [[0, 1, 0, 0, 1, 0]]),
    ],
)
def test_extension_adds_copies_that_move_no_token(p2l, expected):
    from nemo_moe_metrics.placement.plan import extend_placement, gpu_loads

    grown = extend_placement(np.array(p2l), 3, 2)
    assert grown.tolist() == expected
    weight = np.array([[7, 3, 5]])
    assert np.array_equal(gpu_loads(weight, grown, 2), gpu_loads(weight, np.array(p2l), 2))
