"""Balance statistics: properties (hypothesis) and hand-computed values."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.balance import (
    ExpertLoads,
    coefficient_of_variation,
    dropped_fraction,
    ep_imbalance,
    expert_load_metrics,
    layer_statistics,
    linear_percentile,
    load_percent,
    max_over_ideal,
    min_over_ideal,
    normalized_entropy,
    padding_fraction,
    zero_token_experts,
)

loads_1d = st.lists(st.integers(0, 10_000), min_size=1, max_size=64)
nonempty = loads_1d.filter(lambda c: sum(c) > 0)


@given(nonempty)
def test_load_percents_sum_to_100(c):
    assert math.isclose(load_percent(np.array(c)).sum(), 100.0, rel_tol=1e-9)


@given(st.integers(1, 64), st.integers(1, 1000))
def test_uniform_load_is_ideal(experts, per_expert):
    c = np.full(experts, per_expert)
    assert max_over_ideal(c) == pytest.approx(1.0)
    assert min_over_ideal(c) == pytest.approx(1.0)
    assert coefficient_of_variation(c) == pytest.approx(0.0)
    assert normalized_entropy(c) == pytest.approx(1.0)
    assert zero_token_experts(c) == 0


@given(nonempty)
def test_max_over_ideal_at_least_one_and_min_at_most_one(c):
    assert max_over_ideal(np.array(c)) >= 1.0 - 1e-12
    assert min_over_ideal(np.array(c)) <= 1.0 + 1e-12
    assert 0.0 <= normalized_entropy(np.array(c)) <= 1.0 + 1e-12


@settings(max_examples=50)
@given(nonempty, st.randoms(use_true_random=False))
def test_statistics_are_permutation_invariant(c, rnd):
    perm = list(c)
    rnd.shuffle(perm)
    a = layer_statistics(np.array(c), routed_tokens=sum(c), topk=1)
    b = layer_statistics(np.array(perm), routed_tokens=sum(c), topk=1)
    a.pop("ep_imbalance"), b.pop("ep_imbalance")  # depends on placement by design
    assert a == pytest.approx(b)


@given(loads_1d)
def test_empty_or_not_no_statistic_is_nan(c):
    s = layer_statistics(np.array(c), routed_tokens=sum(c), topk=1)
    assert all(math.isfinite(v) for v in s.values())


def test_hand_computed_values():
    c = np.array([6, 2, 0, 0])  # mean 2
    assert max_over_ideal(c) == 3.0
    assert min_over_ideal(c) == 0.0
    assert coefficient_of_variation(c) == pytest.approx(np.sqrt((16 + 0 + 4 + 4) / 4) / 2)
    p = np.array([0.75, 0.25])
    assert normalized_entropy(c) == pytest.approx(-(p * np.log(p)).sum() / np.log(4))
    assert zero_token_experts(c) == 2


def test_ep_imbalance_groups_contiguous_experts_per_rank():
    # ep=2: rank 0 holds experts 0,1 (6+2=8), rank 1 holds 2,3 (0+0) -> max/mean = 8/4.
    assert ep_imbalance(np.array([6, 2, 0, 0]), ep_size=2) == 2.0
    # Imbalanced experts can still be balanced across EP ranks: 4+0 vs 0+4.
    assert max_over_ideal(np.array([4, 0, 0, 4])) == 2.0
    assert ep_imbalance(np.array([4, 0, 0, 4]), ep_size=2) == 1.0
    with pytest.raises(ValueError, match="divide the number of experts"):
        ep_imbalance(np.array([1, 2, 3]), ep_size=2)


def test_dropped_fraction_counts_capacity_drops():
    assert dropped_fraction(np.array([5, 5, 4, 4]), routed_tokens=10, topk=2) == pytest.approx(0.1)
    assert dropped_fraction(np.array([5, 5, 5, 5]), routed_tokens=10, topk=2) == 0.0
    assert dropped_fraction(np.array([0, 0]), routed_tokens=0, topk=2) == 0.0


def test_empty_layer_gives_zeros_not_nan():
    s = layer_statistics(np.zeros(8, dtype=np.int64), routed_tokens=0, topk=2, ep_size=2)
    assert s == {k: 0.0 for k in mn.LAYER_STATS}


def _loads():
    return ExpertLoads(
        layer_ids=[1, 3, 4],
        counts=np.array([[6, 2, 0, 0], [2, 2, 2, 2], [0, 0, 0, 0]]),
        routed_tokens=np.array([4, 4, 0]),
        topk=2,
    )


def test_summaries_over_moe_layers():
    m = expert_load_metrics(_loads(), per_layer=False, table=False, ep_size=2)
    assert set(m) == set(mn.BALANCE_SUMMARY_KEYS)
    assert m[mn.MAX_OVER_IDEAL] == pytest.approx((3.0 + 1.0) / 2)  # empty layer 4 left out
    assert m[mn.MAX_OVER_IDEAL_MAX] == 3.0
    assert m[mn.EP_IMBALANCE] == pytest.approx((2.0 + 1.0) / 2)
    assert m[mn.EP_IMBALANCE_MAX] == 2.0
    assert m[mn.DEAD_EXPERTS] == 2.0
    assert m[mn.DROPPED_FRACTION] == 0.0


def test_per_layer_keys_use_global_layer_ids():
    m = expert_load_metrics(_loads(), per_layer=True, table=False)
    assert m[mn.layer_stat_key(1, "max_over_ideal")] == 3.0
    assert m[mn.layer_stat_key(3, "normalized_entropy")] == pytest.approx(1.0)
    assert m[mn.layer_stat_key(4, "max_over_ideal")] == 0.0
    assert {k for k in m if k.startswith("moe/layer_")} == {
        mn.layer_stat_key(i, s) for i in (1, 3, 4) for s in mn.LAYER_STATS
    }


def test_table_rows_are_layer_expert_tokens_percent():
    rows = expert_load_metrics(_loads(), per_layer=False, table=True)[mn.EXPERT_LOADS]
    assert len(rows) == 12
    assert rows[0] == [1, 0, 6, 75.0] and rows[1] == [1, 1, 2, 25.0]
    assert rows[4] == [3, 0, 2, 25.0]
    assert rows[-1] == [4, 3, 0, 0.0]


def test_padded_rows_use_only_real_experts():
    loads = ExpertLoads([0, 1], np.array([[2, 2, 0, 0], [1, 1, 1, 1]]), np.array([2, 2]), 2, [2, 4])
    m = expert_load_metrics(loads, per_layer=True, table=True)
    assert m[mn.layer_stat_key(0, "zero_token_experts")] == 0.0
    assert len(m[mn.EXPERT_LOADS]) == 6


def test_no_moe_layers_gives_no_metrics():
    empty = ExpertLoads([], np.zeros((0, 0), dtype=np.int64), np.zeros(0, dtype=np.int64), 0)
    assert expert_load_metrics(empty, per_layer=True, table=True) == {}


def test_inconsistent_loads_raise_clear_error():
    bad = ExpertLoads([0, 1], np.zeros((1, 4)), np.zeros(2), 2)
    with pytest.raises(ValueError, match="inconsistent"):
        expert_load_metrics(bad, per_layer=False, table=False)


def test_negative_counts_are_rejected():
    with pytest.raises(ValueError, match=">= 0"):
        max_over_ideal(np.array([1, -1]))


def test_ep_imbalance_reads_executed_counts_and_routing_statistics_read_routed_ones():
    routed = np.array([[4, 4, 4, 4]])
    executed = np.array([[4, 4, 10, 10]])  # 12 padding assignments on EP rank 1's experts
    loads = ExpertLoads([0], routed, np.array([8]), 2, [4], executed)
    m = expert_load_metrics(loads, per_layer=True, table=True, ep_size=2)
    assert m[mn.layer_stat_key(0, "max_over_ideal")] == 1.0  # 4 * 4 / 16
    assert m[mn.EP_IMBALANCE] == pytest.approx(20 / ((8 + 20) / 2))
    assert m[mn.PADDING_FRACTION] == pytest.approx(1 - 16 / 28)
    assert m[mn.layer_stat_key(0, "padding_fraction")] == pytest.approx(1 - 16 / 28)
    assert [row[2] for row in m[mn.EXPERT_LOADS]] == [4, 4, 4, 4]  # the table is routed


def test_without_executed_counts_padding_fraction_is_zero():
    loads = ExpertLoads([0], np.array([[3, 1]]), np.array([2]), 2)
    m = expert_load_metrics(loads, per_layer=False, table=False, ep_size=2)
    assert m[mn.PADDING_FRACTION] == 0.0
    assert m[mn.EP_IMBALANCE] == pytest.approx(3 / 2)


def test_routed_above_executed_is_an_error():
    with pytest.raises(ValueError, match="exceed executed counts"):
        padding_fraction(np.array([5, 5]), np.array([1, 1]))


def test_every_layer_at_once_equals_layer_statistics_layer_by_layer():
    # expert_load_metrics computes all layers in one numpy pass when they share their experts;
    # each layer's keys must be layer_statistics' own, empty layers and zero picks included.
    rng = np.random.default_rng(0)
    for trial in range(200):
        layers, experts = int(rng.integers(1, 6)), int(rng.choice([1, 2, 4, 8, 16]))
        counts = rng.integers(0, 50, size=(layers, experts)) * (rng.random((layers, experts)) > 0.3)
        if trial % 7 == 0:
            counts[0] = 0  # an empty layer beside routed ones
        counts[-1, 0] += 1  # a step that routed something (else only moe/routed_tokens)
        executed = counts + rng.integers(0, 5, size=(layers, experts))
        topk = int(rng.integers(1, experts + 1))
        tokens = counts.sum(1) // topk + rng.integers(0, 5, size=layers)
        zero = rng.integers(0, 3, size=layers) if trial % 3 == 0 else None
        ep = int(rng.choice([d for d in (1, 2, 4) if experts % d == 0]))
        loads = ExpertLoads(list(range(layers)), counts, tokens, topk, executed=executed,
                            zero_picks=zero)  # fmt: skip
        got = expert_load_metrics(loads, per_layer=True, table=False, ep_size=ep)
        for i in range(layers):
            expected = layer_statistics(
                counts[i], int(tokens[i]), topk, ep, executed=executed[i],
                zero_picks=None if zero is None else int(zero[i]),
            )  # fmt: skip
            for name, value in expected.items():
                assert got[mn.layer_stat_key(i, name)] == pytest.approx(value, rel=1e-12, abs=1e-15)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.floats(0.0, 64.0), st.sampled_from([1.0, 1.25, 2.0])), min_size=1, max_size=120
    ),
    st.sampled_from([0.0, 10.0, 50.0, 90.0, 99.0, 100.0]),
)
def test_linear_percentile_is_numpys_to_the_bit(values, percent):
    want = float(np.percentile(np.array(values, dtype=np.float64), percent))
    assert linear_percentile(sorted(values), percent) == want
