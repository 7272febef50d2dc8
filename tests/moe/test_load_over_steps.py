"""Routing drift and dead-expert streaks against computations written independently here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nemo_moe_metrics.moe.load_over_steps import (
    DeadStreaks,
    Drift,
    Streak,
    entropy_from_counts,
    js_divergence,
    shares,
)


def _js_by_hand(a: list[int], b: list[int]) -> float:
    """JS in bits from its definition: mean KL of each distribution to their midpoint."""
    p = [x / sum(a) for x in a]
    q = [x / sum(b) for x in b]
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    kl_p = sum(x * math.log2(x / z) for x, z in zip(p, m, strict=True) if x > 0)
    kl_q = sum(y * math.log2(y / z) for y, z in zip(q, m, strict=True) if y > 0)
    return (kl_p + kl_q) / 2


def test_js_divergence_matches_the_definition_on_random_counts_with_zeros():
    rng = np.random.default_rng(3)
    prev = rng.integers(0, 50, (20, 16))
    cur = rng.integers(0, 50, (20, 16))
    prev[:, :3] = 0  # experts without tokens on one side only
    cur[:, 5] = 0
    got = js_divergence(prev, cur)
    want = [_js_by_hand(a.tolist(), b.tolist()) for a, b in zip(prev, cur, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_js_divergence_is_0_for_same_shares_and_1_for_disjoint_experts():
    same = js_divergence(np.array([[10, 30, 0, 60]]), np.array([[1, 3, 0, 6]]))
    disjoint = js_divergence(np.array([[5, 5, 0, 0]]), np.array([[0, 0, 7, 1]]))
    assert same[0] == pytest.approx(0.0, abs=1e-12)
    assert disjoint[0] == pytest.approx(1.0, abs=1e-12)


def test_js_divergence_is_nan_when_a_step_routed_nothing():
    assert np.isnan(js_divergence(np.array([[0, 0]]), np.array([[1, 2]]))[0])


@pytest.mark.parametrize("top", [40, 1_200_000, (1 << 22) + 5])
@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
def test_entropy_from_counts_is_the_entropy_of_the_shares(top, dtype):
    rng = np.random.default_rng(top)
    counts = rng.integers(0, top, (6, 5, 32)).astype(dtype)
    counts[0, 1] = 0  # an empty row: NaN, as for its shares
    counts[2, :, :4] = 0
    got = entropy_from_counts(counts)
    by_hand = [
        -sum(c / sum(row) * math.log2(c / sum(row)) for c in row if c) if sum(row) else math.nan
        for row in counts.reshape(-1, 32).astype(float).tolist()
    ]
    np.testing.assert_allclose(got.reshape(-1), by_hand, rtol=1e-12, atol=1e-12)
    assert np.isnan(got[0, 1]) and np.isnan(shares(counts)[0, 1]).all()
    with pytest.raises(ValueError, match=">= 0"):
        entropy_from_counts(np.array([[3, -1]]))


def test_drift_compares_each_step_with_the_previous_one():
    rng = np.random.default_rng(4)
    steps = [rng.integers(1, 100, (3, 8)) for _ in range(4)]
    drift = Drift()
    first = drift.update(steps[0])
    assert np.isnan(first).all()
    for before, after in zip(steps, steps[1:], strict=False):
        want = [_js_by_hand(a.tolist(), b.tolist()) for a, b in zip(before, after, strict=True)]
        np.testing.assert_allclose(drift.update(after), want, rtol=1e-9)


def _streaks_by_hand(zero: np.ndarray, steps: list[int], n: int) -> set[tuple]:
    """Maximal runs of True along the step axis of ``zero[step, layer, expert]``; a step at
    which the whole layer is zero (nothing routed) is not a dead step."""
    out = set()
    _, layers, experts = zero.shape
    for la in range(layers):
        for ex in range(experts):
            run_start = None
            for i in range(len(steps) + 1):
                dead = i < len(steps) and zero[i, la, ex] and not zero[i, la].all()
                if dead and run_start is None:
                    run_start = i
                if not dead and run_start is not None:
                    length = i - run_start
                    if length >= n:
                        ongoing = i == len(steps)
                        out.add((la, ex, steps[run_start], steps[i - 1], length, ongoing))
                    run_start = None
    return out


def test_dead_streaks_match_runs_of_zeros_found_by_hand():
    rng = np.random.default_rng(5)
    steps = list(range(0, 120, 3))  # logged every 3rd step
    zero = rng.random((len(steps), 4, 6)) < 0.45
    counts = np.where(zero, 0, rng.integers(1, 9, zero.shape))
    tracker = DeadStreaks(min_steps=3)
    for step, c in zip(steps, counts, strict=True):
        tracker.update(step, [10, 11, 12, 13], c)
    got = {
        (s.layer - 10, s.expert, s.first, s.last, s.length, s.ongoing) for s in tracker.streaks()
    }
    assert got == _streaks_by_hand(zero, steps, 3)
    assert got, "the random pattern should hold at least one streak of 3"


def test_a_layer_that_routed_nothing_ends_its_streaks():
    tracker = DeadStreaks(min_steps=2)
    tracker.update(0, [0], np.array([[0, 5]]))
    tracker.update(1, [0], np.array([[0, 5]]))
    tracker.update(2, [0], np.array([[0, 0]]))  # nothing routed: nothing can be judged
    tracker.update(3, [0], np.array([[0, 5]]))
    assert tracker.streaks() == [Streak(0, 0, 0, 1, 2, False)]


@pytest.mark.parametrize("min_steps", [1, 3])
def test_streaks_of_a_block_equal_those_of_its_steps_one_by_one(min_steps):
    rng = np.random.default_rng(11)
    counts = rng.integers(1, 9, (40, 4, 6))
    counts[rng.random(counts.shape) < 0.25] = 0  # streaks start and end inside blocks
    counts[17, 2] = 0  # a layer that routed nothing ends its streaks
    steps = list(range(100, 140))
    one = DeadStreaks(min_steps)
    for s, c in zip(steps, counts, strict=True):
        one.update(s, [0, 1, 2, 3], c)
    blocked = DeadStreaks(min_steps)
    for lo, hi in [(0, 1), (1, 9), (9, 10), (10, 33), (33, 40)]:
        blocked.update_block(steps[lo:hi], [0, 1, 2, 3], counts[lo:hi])
    assert blocked.streaks() == one.streaks()
    assert len(one.streaks()) > 3
    assert np.array_equal(blocked.first_steps[counts[-1] == 0], one.first_steps[counts[-1] == 0])
