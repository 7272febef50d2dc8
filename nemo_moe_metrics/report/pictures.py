"""The report's pictures (matplotlib, imported inside each function)."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.moe.load_over_steps import real_experts
from nemo_moe_metrics.report.reading import ReportError, RunInfo
from nemo_moe_metrics.report.timeline import StepBins, Timeline

# Every picture's name lives in run_dir.names.PICTURES (what an overwrite deletes); named here too.
from nemo_moe_metrics.run_dir.names import DRIFT_FILE as DRIFT_FILE
from nemo_moe_metrics.run_dir.names import HEATMAP_FILE as HEATMAP_FILE
from nemo_moe_metrics.run_dir.names import MAX_OVER_IDEAL_FILE as MAX_OVER_IDEAL_FILE
from nemo_moe_metrics.run_dir.names import OVER_STEPS_FILE as OVER_STEPS_FILE
from nemo_moe_metrics.run_dir.names import ROUTING_DISAGREEMENT_FILE as ROUTING_DISAGREEMENT_FILE

_DPI = 110


def save_figure(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` whole or not at all: into a temporary file beside it, renamed
    over ``path`` when complete. A full disk leaves no cut or empty picture behind (an older
    picture stays as it was) and raises :class:`ReportError` saying so."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ReportError(
            f"cannot write {path}: {err.strerror or err}; nothing was left half-written. "
            "Free space on that disk, or write the pictures elsewhere with --out DIR"
        ) from None


def steps_label(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}–{steps[-1]} ({len(steps)} logged, tokens summed)"


def _ratio_label(exp: float) -> str:
    if exp >= 0:
        return f"×{2**exp:g}"
    return f"×1/{2 ** (-exp):g}"


def log_ratio(counts: np.ndarray, widths: Any = None) -> tuple[np.ndarray, np.ma.MaskedArray]:
    """Load / ideal over the last axis and its log2, masked where an expert got no token.

    ``widths`` ``[L]`` (counts ``[..., L, E]``): each layer's number of experts when they
    differ; the ideal is then the layer's tokens / its own experts (padding columns are 0,
    so masked)."""
    totals = counts.sum(axis=-1, keepdims=True)
    width = counts.shape[-1] if widths is None else np.asarray(widths)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = counts * width / totals
        log_ratio = np.log2(ratio)
    return ratio, np.ma.masked_array(log_ratio, mask=(counts == 0) | ~np.isfinite(log_ratio))


def _worst(shown: np.ma.MaskedArray) -> float:
    """The largest |log2 ratio| of a picture (0 when every cell is masked)."""
    return float(np.abs(shown).max()) if shown.count() else 0.0


def colour_limit(heat: np.ma.MaskedArray, over_steps: np.ma.MaskedArray) -> float:
    """The colour limit shared by both pictures: symmetric whole powers of two, at least
    x1/2..x2, at most x1/32..x32. The heatmap's cells all count; over steps, the 99.9th
    percentile, so that a short collapse does not wash out the rest of the run (the colour
    bar's arrows mark values beyond the limit)."""
    scale = _worst(heat)
    if over_steps.count():
        scale = max(scale, float(np.quantile(np.abs(over_steps.compressed()), 0.999)))
    return float(min(max(1, math.ceil(scale - 1e-9)), 5))


def _colour_map() -> Any:
    from matplotlib import colormaps

    return colormaps["RdBu_r"].with_extremes(bad="black")


# Cells beyond a layer's experts (layers with fewer experts than the widest): no expert, so
# neither a colour of the load scale nor the black of a 0-token expert.
_NO_EXPERT = "#d4d4d4"
_NO_EXPERT_NOTE = "grey = no such expert in that layer"


def _grey_cells(draw: Callable[..., Any], absent: np.ndarray) -> None:
    """Paint the cells where ``absent`` is True grey, over the load image: ``draw(cells,
    **colours)`` is the load image's ``imshow`` or ``pcolormesh`` with its geometry bound."""
    from matplotlib.colors import ListedColormap

    cells = np.ma.masked_array(np.zeros(absent.shape), mask=~absent)
    draw(cells, cmap=ListedColormap([_NO_EXPERT]), vmin=0, vmax=1)


def _colour_bar(fig: Any, image: Any, axes: Any, limit: float, worst: float, aspect: float) -> None:
    ticks = np.arange(-limit, limit + 1)
    bar = fig.colorbar(
        image,
        ax=axes,
        ticks=ticks,
        extend="both" if worst > limit else "neither",
        pad=0.01,
        aspect=aspect,
    )
    bar.ax.set_yticklabels([_ratio_label(t) for t in ticks])
    bar.set_label("expert load / ideal  (log scale; white = balanced)")


def render_heatmap(
    run: RunInfo,
    path: Path,
    layer_ids: list[int],
    counts: np.ndarray,
    steps: list[int],
    lim: float,
    widths: np.ndarray | None = None,
) -> None:
    """``widths``: each layer's number of experts when they differ (cells beyond are grey)."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    n_layers, n_experts = counts.shape
    ratio, shown = log_ratio(counts, widths)
    real = real_experts(widths, n_experts)
    dead = counts == 0 if real is None else (counts == 0) & real
    worst = _worst(shown)
    height = min(max(0.28 * n_layers + 2.2, 3.6), 14.0)
    fig = Figure(figsize=(11, height), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(
        shown,
        cmap=_colour_map(),
        norm=Normalize(-lim, lim),
        aspect="auto",
        interpolation="nearest",
        origin="upper",
    )
    if real is not None:
        draw = partial(ax.imshow, aspect="auto", interpolation="nearest", origin="upper")
        _grey_cells(draw, ~real)
    # A bar about 0.35 inch wide whatever the figure height.
    _colour_bar(fig, image, ax, lim, worst, 2.5 * height)
    ax.set_xlabel(f"expert (0–{n_experts - 1})")
    ax.set_ylabel("MoE layer (global index)")
    ax.set_xticks(np.arange(0, n_experts, _nice_stride(n_experts, 16)))
    rows = np.arange(0, n_layers, _nice_stride(n_layers, 24))
    ax.set_yticks(rows, [str(layer_ids[r]) for r in rows])
    if n_layers * n_experts <= 256:
        # Small grids: print each multiple so nobody has to decode colours.
        for (r, e), v in np.ndenumerate(ratio):
            if np.isfinite(v) and (real is None or real[r, e]):
                dark = v == 0 or abs(math.log2(v)) > 0.6 * lim
                ax.text(
                    e,
                    r,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if dark else "black",
                )
    dead_note = f"; black = 0 tokens ({int(dead.sum())} dead)" if dead.any() else ""
    if real is not None:
        dead_note += f"; {_NO_EXPERT_NOTE}"
    ax.set_title(
        f"{run.model_label(n_layers, n_experts if widths is None else widths)}\n"
        f"expert load / ideal, {steps_label(steps)}{dead_note}",
        fontsize=10,
        loc="left",
    )
    save_figure(fig, path)


def bin_ratios(
    bins: StepBins, rows: list[int], widths: np.ndarray | None = None
) -> tuple[np.ndarray, np.ma.MaskedArray]:
    """[len(rows), experts, bins] log2 load/ideal of the chosen layer rows, per step bin
    (``widths``: every layer's number of experts when they differ)."""
    sums = bins.sums[: bins.used][:, rows, :]  # [bins, layers, E]
    _, shown = log_ratio(sums, None if widths is None else np.asarray(widths)[rows])
    return sums, np.ma.transpose(shown, (1, 2, 0))


def column_edges(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """x edges of step-bin columns: each column centred on its bin's steps, no gap between.

    A bin covering steps ``first..last`` is centred on ``(first + last) / 2``; neighbouring
    columns meet half way between centres, and the outer columns are as wide as their neighbour
    side. One logged step per bin thus puts step ``s`` at the middle of its column (not at its
    left edge), and the axis does not run past the last logged step by a whole column.
    """
    centres = (np.asarray(first, dtype=float) + np.asarray(last, dtype=float)) / 2
    if centres.size == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    inner = (centres[:-1] + centres[1:]) / 2
    return np.concatenate(
        [[centres[0] - (inner[0] - centres[0])], inner, [centres[-1] + (centres[-1] - inner[-1])]]
    )


def step_ticks(first_step: int, last_step: int, max_ticks: int = 10) -> np.ndarray:
    """Whole-number step ticks inside ``first_step..last_step`` (never a step that was not run)."""
    from matplotlib.ticker import MaxNLocator

    ticks = MaxNLocator(nbins=max_ticks, integer=True).tick_values(first_step, last_step)
    return ticks[(ticks >= first_step) & (ticks <= last_step)]


def render_over_steps(
    run: RunInfo,
    path: Path,
    timeline: Timeline,
    rows: list[int],
    shown: np.ma.MaskedArray,
    lim: float,
    why: str,
) -> None:
    save_figure(over_steps_figure(run, timeline, rows, shown, lim, why), path)


def over_steps_figure(
    run: RunInfo,
    timeline: Timeline,
    rows: list[int],
    shown: np.ma.MaskedArray,
    lim: float,
    why: str,
) -> Any:
    """The matplotlib Figure of ``expert_load_over_steps.png`` (see :func:`render_over_steps`)."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    bins = timeline.bins
    assert bins is not None
    n_experts = shown.shape[1]
    edges = column_edges(bins.first[: bins.used], bins.last[: bins.used])
    panel = min(max(n_experts / 64, 1.6), 3.2)
    height = panel * len(rows) + 1.4
    fig = Figure(figsize=(11, height), dpi=_DPI, layout="constrained")
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    worst = _worst(shown)
    moi = np.asarray(timeline.moi)
    widths = timeline.layer_widths()
    image = None
    absent = False
    for ax, row, data in zip(axes, rows, shown, strict=True):
        image = ax.pcolormesh(
            edges,
            np.arange(n_experts + 1) - 0.5,
            data,
            cmap=_colour_map(),
            norm=Normalize(-lim, lim),
            shading="flat",
        )
        width = int(widths[row])
        if width < n_experts:  # the rows beyond this layer's experts are no expert: grey
            absent = True
            no_expert = np.broadcast_to((np.arange(n_experts) >= width)[:, None], data.shape)
            draw = partial(ax.pcolormesh, edges, np.arange(n_experts + 1) - 0.5, shading="flat")
            _grey_cells(draw, no_expert)
        ax.set_ylim(n_experts - 0.5, -0.5)  # expert 0 on top, as in the heatmap
        # Every expert labelled while they fit (32 per panel), else every 2nd, 4th, ...
        ticks = np.arange(0, width, _nice_stride(n_experts, 32))
        ax.set_yticks(ticks, [str(e) for e in ticks], fontsize=7 if n_experts > 16 else None)
        mean = np.nanmean(moi[:, row])
        ax.set_ylabel(f"layer {timeline.layer_ids[row]}: expert\n(mean max/ideal {mean:.2f})")
    axes[-1].set_xlabel("training step")
    axes[-1].set_xlim(edges[0], edges[-1])
    axes[-1].set_xticks(step_ticks(timeline.steps[0], timeline.steps[-1]))
    _colour_bar(fig, image, list(axes), lim, worst, 2.5 * height)
    per_bin = (
        "one column per logged step"
        if bins.width == 1
        else f"each column sums the tokens of {bins.width} logged steps"
    )
    real = np.arange(n_experts)[None, :, None] < widths[rows][:, None, None]
    dead = "; black = 0 tokens" if (np.ma.getmaskarray(shown) & real).any() else ""
    if absent:
        dead += f"; {_NO_EXPERT_NOTE}"
    axes[0].set_title(
        f"{run.model_label(len(timeline.layer_ids), widths)}\nexpert load / ideal over "
        f"steps {timeline.steps[0]}–{timeline.steps[-1]}, {why}; {per_bin}{dead}",
        fontsize=10,
        loc="left",
    )
    return fig


def _nice_stride(n: int, max_ticks: int) -> int:
    stride = 1
    while n / stride > max_ticks:
        stride *= 2
    return stride


def layer_colours() -> Any:
    """The colour map of per-layer lines: viridis without its pale yellow end (faint on white)."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    return ListedColormap(colormaps["viridis"](np.linspace(0.0, LAYER_COLOUR_TOP, 256)))


# Where the per-layer colours stop along viridis: its top (yellow) is too faint on white.
LAYER_COLOUR_TOP = 0.65


# A line picture is about 1,000 pixels wide: more points than this per line are drawn as each
# column's lowest and highest value (``envelope``), which looks the same and keeps spikes.
_MAX_POINTS = 1_200


def envelope(steps: Any, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x [n], y [..., n])`` of series ``values`` ``[..., steps]``: unchanged up to
    ``_MAX_POINTS`` steps; beyond, the steps are cut into ``_MAX_POINTS // 2`` runs and each
    run is drawn as its lowest and highest value (in the order they occur), at its first and
    last step. Every spike and dip of the full series stays in the picture."""
    x = np.asarray(steps, dtype=np.float64)
    n = x.size
    if n <= _MAX_POINTS:
        return x, values
    runs = _MAX_POINTS // 2
    edges = np.linspace(0, n, runs + 1).astype(np.int64)
    lead = values.shape[:-1]
    flat = values.reshape(-1, n)
    out = np.full((flat.shape[0], 2 * runs), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN runs stay NaN
        lo = np.fmin.reduceat(flat, edges[:-1], axis=1)
        hi = np.fmax.reduceat(flat, edges[:-1], axis=1)
    # Which comes first within the run: the lowest or the highest value.
    filled = np.where(np.isnan(flat), np.inf, flat)
    first_lo = np.minimum.reduceat(filled, edges[:-1], axis=1)
    pos = np.arange(n)
    lo_at = np.minimum.reduceat(
        np.where(filled == np.repeat(first_lo, np.diff(edges), axis=1), pos, n), edges[:-1], axis=1
    )
    filled = np.where(np.isnan(flat), -np.inf, flat)
    first_hi = np.maximum.reduceat(filled, edges[:-1], axis=1)
    hi_at = np.minimum.reduceat(
        np.where(filled == np.repeat(first_hi, np.diff(edges), axis=1), pos, n), edges[:-1], axis=1
    )
    lo_first = lo_at <= hi_at
    out[:, 0::2] = np.where(lo_first, lo, hi)
    out[:, 1::2] = np.where(lo_first, hi, lo)
    xs = np.empty(2 * runs)
    xs[0::2] = x[edges[:-1]]
    xs[1::2] = x[edges[1:] - 1]
    return xs, out.reshape(*lead, 2 * runs)


def _run_means(steps: Any, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x [runs], y [..., runs])``: the mean of each of ``envelope``'s runs (NaN where a run
    holds no value), at the run's centre. Many layers' faint lines are drawn this way: Agg
    needs about 5x longer for 94 zig-zagging envelopes, and the band keeps every extreme."""
    x = np.asarray(steps, dtype=np.float64)
    edges = np.linspace(0, x.size, _MAX_POINTS // 2 + 1).astype(np.int64)
    flat = values.reshape(-1, x.size)
    finite = np.isfinite(flat)
    sums = np.add.reduceat(np.where(finite, flat, 0.0), edges[:-1], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        means = sums / np.add.reduceat(finite, edges[:-1], axis=1)
    centres = (x[edges[:-1]] + x[edges[1:] - 1]) / 2
    return centres, means.reshape(*values.shape[:-1], edges.size - 1)


def render_layer_series(
    run: RunInfo,
    path: Path,
    steps: list[int],
    series: dict[int, np.ndarray],
    *,
    ylabel: str,
    title: str,
    ideal: float | None,
) -> None:
    """One line per layer over steps: many layers as a band, the worst in red, the mean black."""
    fig = layer_series_figure(run, steps, series, ylabel=ylabel, title=title, ideal=ideal)
    save_figure(fig, path)


def layer_series_figure(
    run: RunInfo,
    steps: list[int],
    series: dict[int, np.ndarray],
    *,
    ylabel: str,
    title: str,
    ideal: float | None,
) -> Any:
    """The matplotlib Figure of :func:`render_layer_series`; the legend sits below the axes,
    where it never covers a point."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    marker = "o" if len(steps) <= 20 else None
    layers = list(series)
    values = np.array([series[la] for la in layers], dtype=np.float64)  # [layers, steps]
    many = len(layers) > 10
    cmap = layer_colours()
    norm = Normalize(min(layers), max(max(layers), min(layers) + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: empty steps
        low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
        mean = np.nanmean(values, axis=0)
        layer_means = np.nanmean(values, axis=1)
    worst = layers[int(np.nanargmax(np.where(np.isnan(layer_means), -np.inf, layer_means)))]
    # Long runs: each line as its per-column envelope (same look, every spike kept); many
    # layers' faint lines as run means (the band and the worst layer keep the extremes).
    x, envelopes = envelope(steps, values)
    long_run = x.size != len(steps)
    faint_x, faint = _run_means(steps, values) if long_run and many else (x, envelopes)
    if long_run:  # the band: each run's lowest low and highest high
        _, band = envelope(steps, np.stack([low, high]))
        low = np.repeat(np.fmin(band[0, 0::2], band[0, 1::2]), 2)
        high = np.repeat(np.fmax(band[1, 0::2], band[1, 1::2]), 2)
        _, mean = envelope(steps, mean)
    steps = x
    if many:
        # Many layers: a min-max band and faint lines, the worst layer picked out in red.
        ax.fill_between(steps, low, high, color="tab:blue", alpha=0.12, label="range over layers")
    for i, layer in enumerate(layers):
        highlight = many and layer == worst
        xs, ys = (faint_x, faint[i]) if many and not highlight else (x, envelopes[i])
        ax.plot(
            xs,
            ys,
            color="tab:red" if highlight else cmap(norm(layer)),
            lw=2.0 if highlight else 1.0,
            alpha=1.0 if highlight or not many else 0.35,
            marker=marker,
            ms=3,
            zorder=3 if highlight else 2,
            label=(f"worst layer ({layer})" if highlight else None) if many else f"layer {layer}",
        )
    ax.plot(
        steps, mean, color="black", lw=2.4, marker=marker, ms=4, zorder=4, label="mean over layers"
    )
    if ideal is not None:
        ax.axhline(ideal, color="grey", ls="--", lw=1, label="ideal (perfect balance)")
        finite = mean[np.isfinite(mean)]
        ax.set_ylim(bottom=min(0.95, float(finite.min()) - 0.05) if finite.size else 0)
    else:
        positive = values[np.isfinite(values) & (values > 0)]
        if positive.size and positive.max() > 100 * positive.min():
            # Spikes and the noise floor both stay readable on a log axis.
            ax.set_yscale("log")
            ax.set_ylim(bottom=max(float(positive.min()), 1e-6))
        else:
            ax.set_ylim(bottom=0)
    if many:
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="MoE layer", pad=0.01)
    # Below the axes (constrained layout makes room): a legend inside covers the last points.
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncols=min(len(labels), 4))
    ax.set_xlabel("training step")
    ax.set_xticks(step_ticks(steps[0], steps[-1]))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_title(f"{run.name}: {title}", fontsize=10, loc="left")
    return fig


# --- the report --------------------------------------------------------------------------------
