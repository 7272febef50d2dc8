"""The report's pictures (report/pictures.py): step columns, legends and line series that stay
readable at every size."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.report.pictures import envelope

# --------------------------------------------------------------------------- 7. pictures


def _timeline(steps, n_experts=4):
    import numpy as np

    from nemo_moe_metrics.report.timeline import Timeline

    timeline = Timeline(keep_sum=False, dead_steps=10)
    rng = np.random.default_rng(0)
    for step in steps:
        timeline.add(step, [1, 3], rng.integers(1, 50, size=(2, n_experts)))
    return timeline


@pytest.mark.parametrize("steps", [[0, 1, 2, 3], [5, 10, 15, 20, 25]])
def test_over_steps_columns_are_centred_on_their_steps_with_no_extra_tick(steps):
    import numpy as np

    from nemo_moe_metrics.report.pictures import bin_ratios, over_steps_figure
    from nemo_moe_metrics.report.reading import RunInfo

    timeline = _timeline(steps)
    _, shown = bin_ratios(timeline.bins, [0, 1])
    fig = over_steps_figure(RunInfo("t"), timeline, [0, 1], shown, 2.0, "chosen")
    ax = fig.axes[1]  # the bottom panel carries the step axis
    x_edges = ax.collections[0].get_coordinates()[0, :, 0]
    centres = (x_edges[:-1] + x_edges[1:]) / 2
    assert centres.tolist() == pytest.approx(steps)  # each column sits on its logged step
    ticks = ax.get_xticks()
    assert set(ticks) <= set(range(steps[0], steps[-1] + 1)), ticks  # no step that did not run
    assert ticks.min() >= steps[0] and ticks.max() <= steps[-1]
    half = (steps[1] - steps[0]) / 2
    assert ax.get_xlim() == pytest.approx((steps[0] - half, steps[-1] + half))
    assert np.all(np.diff(x_edges) > 0)


@pytest.mark.parametrize("n_layers", [3, 24])
def test_layer_series_legend_never_covers_the_plot_and_no_line_is_faint(n_layers):
    import numpy as np

    from nemo_moe_metrics.report.pictures import layer_series_figure
    from nemo_moe_metrics.report.reading import RunInfo

    steps = list(range(12))
    rng = np.random.default_rng(1)
    series = {la: 1.0 + rng.random(len(steps)) for la in range(n_layers)}
    # The last points high on the right, where an "upper right" legend used to sit.
    for vs in series.values():
        vs[-1] = 2.5
    fig = layer_series_figure(RunInfo("t"), steps, series, ylabel="max/ideal", title="t", ideal=1.0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    (legend,) = fig.legends
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert set(ax.get_xticks()) <= set(steps)

    def contrast_with_white(rgb):
        c = np.where(rgb <= 0.03928, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        lum = 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
        return 1.05 / (lum + 0.05)

    from matplotlib.colors import to_rgb

    rgbs = [np.asarray(to_rgb(line.get_color())) for line in ax.get_lines()]
    worst = min(contrast_with_white(c) for c in rgbs)
    assert worst >= 2.5, worst  # viridis' yellow end is 1.26:1 against white


def test_long_series_are_drawn_as_envelopes_that_keep_every_extreme():
    rng = np.random.default_rng(4)
    values = rng.normal(size=(3, 9_999))
    values[0, 1234] = 40.0  # a one-step spike
    values[1, 8000] = -30.0  # a one-step dip
    values[2, :50] = np.nan  # a layer with no tokens at first
    x, env = envelope(np.arange(9_999) * 2, values)
    assert x.size == env.shape[1] <= 1_200
    assert np.all(np.diff(x) >= 0) and x[0] == 0 and x[-1] == 2 * 9_998
    np.testing.assert_array_equal(np.nanmax(env, axis=1), np.nanmax(values, axis=1))
    np.testing.assert_array_equal(np.nanmin(env, axis=1), np.nanmin(values, axis=1))
    assert np.isnan(env[2, 0])
    short = rng.normal(size=(2, 300))
    assert envelope(range(300), short)[1] is short


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
