"""EPLB in numpy: DeepSeek's published example exactly, hand-checked packing and replication,
valid plans, and the choice between the hierarchical and the global policy."""

import numpy as np
import pytest

from nemo_moe_metrics.placement.eplb import (
    balanced_packing,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
    uses_hierarchical_policy,
)

# github.com/deepseek-ai/EPLB README: two layers of 12 experts, 16 replicas, 4 groups,
# 2 nodes, 8 GPUs, and the phy2log it prints.
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]

README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_reproduces_the_reference_readme_example_exactly():
    plan = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert plan.physical_to_logical.tolist() == README_PHY2LOG
    # The inverse map and the counts agree with phy2log, read independently.
    for layer, row in enumerate(README_PHY2LOG):
        for expert in range(12):
            where = [p for p, e in enumerate(row) if e == expert]
            assert plan.replica_count[layer, expert] == len(where)
            got = [p for p in plan.logical_to_physical[layer, expert] if p >= 0]
            assert sorted(got) == where


def test_balanced_packing_heaviest_first_into_the_lightest_pack_with_room():
    # 5 -> pack 0, 4 -> pack 1, 3 -> pack 1 (4 < 5), 2 -> pack 0 (pack 1 is full).
    pack, rank = balanced_packing(np.array([[5.0, 4.0, 3.0, 2.0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1]]


def test_replication_goes_to_the_highest_load_per_replica():
    # 10 vs 1: copy of 0 (10/1), then 0 again (10/2 = 5 > 1), then 0 (10/3 > 1).
    phy2log, rank, count = replicate_experts(np.array([[10.0, 1.0]]), 5)
    assert phy2log.tolist() == [[0, 1, 0, 0, 0]]
    assert rank.tolist() == [[0, 0, 1, 2, 3]]
    assert count.tolist() == [[4, 1]]


@pytest.mark.parametrize("groups,nodes", [(4, 2), (3, 2), (1, 1), (8, 4)])
def test_every_plan_is_valid(groups, nodes):
    rng = np.random.default_rng(groups * 10 + nodes)
    weight = rng.integers(0, 1000, size=(5, 24))
    gpus, replicas = 8, 32
    plan = rebalance_experts(weight, replicas, groups, nodes, gpus)
    p2l = plan.physical_to_logical
    assert p2l.shape == (5, replicas)
    for layer in range(5):
        counts = np.bincount(p2l[layer], minlength=24)
        assert counts.min() >= 1 and counts.sum() == replicas
        assert counts.tolist() == plan.replica_count[layer].tolist()


def test_global_policy_when_nodes_do_not_divide_groups():
    assert uses_hierarchical_policy(4, 2) and not uses_hierarchical_policy(3, 2)
    weight = np.random.default_rng(1).integers(0, 500, size=(3, 12))
    plan = rebalance_experts(weight, 16, 3, 2, 8)
    phy2log, _, _ = rebalance_experts_hierarchical(weight, 16, 1, 1, 8)
    assert np.array_equal(plan.physical_to_logical, phy2log)


@pytest.mark.parametrize(
    "args,option",
    [
        ((12, 15, 4, 2, 8), "--redundant-experts"),
        ((12, 16, 5, 1, 8), "--groups"),
        ((12, 16, 4, 3, 8), "--nodes"),
    ],
)
def test_impossible_layouts_name_the_option_to_change(args, option):
    experts, replicas, groups, nodes, gpus = args
    with pytest.raises(ValueError, match=option):
        rebalance_experts(np.ones((1, experts)), replicas, groups, nodes, gpus)


def test_the_redundant_expert_error_suggests_counts_that_fit():
    # 12 experts on 8 GPUs: 12 + R divides by 8 for R = 4, 12, 20, ...
    with pytest.raises(ValueError, match=r"to 4, 12, 20"):
        rebalance_experts(np.ones((1, 12)), 15, 1, 1, 8)
