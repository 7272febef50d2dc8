"""Counts over steps (report/timeline.py): the block path (many logged steps per numpy operation)
gives the timeline of single steps; step bins are runs of consecutive logged steps."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.moe.load_over_steps import js_divergence
from nemo_moe_metrics.report.timeline import StepBins, Timeline, bin_width, prepare_block


def _run(seed: int = 2, steps: int = 70) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 40, (steps, 3, 8))
    counts[rng.random(counts.shape) < 0.2] = 0
    counts[30, 1] = 0  # a layer that routed nothing at one step: NaN drift and max/ideal
    return counts


@pytest.mark.parametrize("keep_sum", [False, True])
def test_blocks_give_the_timeline_of_single_steps(keep_sum):
    counts = _run()
    steps = np.arange(5, 5 + 3 * len(counts), 3)
    ids = [7, 2, 4]  # out of order: rows are sorted by layer id
    one = Timeline(keep_sum=keep_sum, dead_steps=2)
    for s, c in zip(steps, counts, strict=True):
        one.add(int(s), ids, c)
    blocked = Timeline(keep_sum=keep_sum, dead_steps=2)
    for lo, hi in [(0, 1), (1, 20), (20, 21), (21, 64), (64, 70)]:
        blocked.add_block(prepare_block(steps[lo:hi], ids, counts[lo:hi]))
    assert blocked.steps == one.steps == steps.tolist()
    assert blocked.layer_ids == [2, 4, 7]
    np.testing.assert_array_equal(np.asarray(blocked.moi), np.asarray(one.moi))
    np.testing.assert_allclose(np.asarray(blocked.drift), np.asarray(one.drift), atol=1e-15)
    np.testing.assert_array_equal(blocked.heat, one.heat)
    assert blocked.streaks.streaks() == one.streaks.streaks()
    b, o = blocked.bins, one.bins
    assert (b.used, b.width) == (o.used, o.width)
    np.testing.assert_array_equal(b.sums[: b.used], o.sums[: o.used])
    np.testing.assert_array_equal(b.first[: b.used], o.first[: o.used])
    np.testing.assert_array_equal(b.last[: b.used], o.last[: o.used])
    # Independently: drift is the JS divergence of consecutive steps, rows in layer order.
    order = [1, 2, 0]
    want = js_divergence(counts[:-1][:, order], counts[1:][:, order])
    np.testing.assert_allclose(np.asarray(blocked.drift), want, atol=1e-12)
    heat = counts.sum(axis=0) if keep_sum else counts[-1]
    np.testing.assert_array_equal(blocked.heat, heat[order])


@pytest.mark.one_line
@pytest.mark.parametrize("max_bins", [2, 8])
def test_step_bins_are_runs_of_bin_width_consecutive_logged_steps(max_bins):
    for logged in range(1, 41):
        bins = StepBins((1, 1), max_bins=max_bins)
        for step in range(logged):
            bins.add(10 * step, np.array([[step]]))
        w = bin_width(logged, max_bins)
        runs = [list(range(logged))[i : i + w] for i in range(0, logged, w)]
        assert bins.width == w and bins.used == len(runs) <= max_bins
        assert bins.first[: bins.used].tolist() == [10 * r[0] for r in runs]
        assert bins.last[: bins.used].tolist() == [10 * r[-1] for r in runs]
        assert bins.sums[: bins.used, 0, 0].tolist() == [sum(r) for r in runs]
        if bins.used > 1:  # merging a partly filled set of bins keeps the rule
            bins.halve()
            runs = [list(range(logged))[i : i + 2 * w] for i in range(0, logged, 2 * w)]
            assert bins.sums[: bins.used, 0, 0].tolist() == [sum(r) for r in runs]
            assert bins.last[: bins.used].tolist() == [10 * r[-1] for r in runs]
