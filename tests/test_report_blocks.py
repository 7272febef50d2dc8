"""The report's block path (many logged steps per numpy operation) against the step-by-step
definitions: same drift, max/ideal, dead streaks, step bins and heat; long line series drawn as
envelopes that keep every extreme."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.moe.load_over_steps import js_divergence
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


def test_many_layers_long_run_faint_lines_are_run_means_and_the_extremes_stay():
    from nemo_moe_metrics.report.pictures import layer_series_figure
    from nemo_moe_metrics.report.reading import RunInfo

    rng = np.random.default_rng(5)
    steps = list(range(0, 2 * 5_000, 2))
    values = 1.0 + rng.random((20, 5_000))
    values[3, 777] = 9.0  # a spike in a faint (not the worst) layer
    values[7, :40] = np.nan  # a layer without tokens at first
    values[11] += 0.5  # the worst layer by mean
    fig = layer_series_figure(
        RunInfo("t"), steps, dict(enumerate(values)), ylabel="y", title="t", ideal=1.0
    )
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    worst = lines["worst layer (11)"]
    assert np.nanmax(worst.get_ydata()) == values[11].max()
    faint = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert len(faint) == 19
    runs = len(faint[0].get_xdata())
    assert runs <= 600
    # Independently: each faint line is the mean of equal runs of steps, NaNs left out.
    edges = np.linspace(0, 5_000, runs + 1).astype(int)
    want = [np.nanmean(values[3, a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    np.testing.assert_allclose(faint[3].get_ydata(), want, rtol=1e-12)
    assert np.isnan(faint[7].get_ydata()[0])
    # The band still reaches the faint layer's spike.
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].max() == 9.0
