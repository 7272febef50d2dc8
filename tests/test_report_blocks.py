"""The report's block path (many logged steps per numpy operation) against the step-by-step
definitions: same drift, max/ideal, dead streaks, step bins and heat; long line series drawn as
envelopes that keep every extreme."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.moe.timeline import js_divergence
from nemo_moe_metrics.report.pictures import _envelope
from nemo_moe_metrics.report.timeline import Timeline, prepare_block


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


def test_long_series_are_drawn_as_envelopes_that_keep_every_extreme():
    rng = np.random.default_rng(4)
    values = rng.normal(size=(3, 9_999))
    values[0, 1234] = 40.0  # a one-step spike
    values[1, 8000] = -30.0  # a one-step dip
    values[2, :50] = np.nan  # a layer with no tokens at first
    x, env = _envelope(np.arange(9_999) * 2, values)
    assert x.size == env.shape[1] <= 1_200
    assert np.all(np.diff(x) >= 0) and x[0] == 0 and x[-1] == 2 * 9_998
    np.testing.assert_array_equal(np.nanmax(env, axis=1), np.nanmax(values, axis=1))
    np.testing.assert_array_equal(np.nanmin(env, axis=1), np.nanmin(values, axis=1))
    assert np.isnan(env[2, 0])
    short = rng.normal(size=(2, 300))
    assert _envelope(range(300), short)[1] is short
