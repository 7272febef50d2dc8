"""Pictures and a text summary of a run directory: its store, ``metrics.jsonl`` and ``run.json``.

``render_report(run_dir)`` writes these PNGs (into the run directory, or ``out_dir``) and
returns the summary:

- ``expert_load_heatmap.png``: MoE layers (rows) x experts (columns); colour is the expert's
  load as a multiple of the ideal (tokens x experts / layer tokens), on a log2 scale centred on
  1: white is balanced, red overloaded, blue underloaded, black an expert that got no token.
  Over a window of steps the tokens are summed first, so the picture is the window's load.
- ``expert_load_over_steps.png``: for the worst layers (or the ones asked for), step x expert
  of the same load / ideal, on the same colour scale; long runs are shown in step bins whose
  tokens are summed.
- ``routing_drift.png``: each layer's Jensen-Shannon divergence between consecutive logged
  steps (how much the router changed its mind).
- ``max_over_ideal.png``: each layer's worst-expert load over ideal, step by step.

The per-step expert counts come from the expert-load store (``expert_loads.bin``), read one
step at a time, or from ``moe/expert_loads`` rows in the JSONL of runs written before the store
existed. The JSONL is streamed for the few scalars the summary needs, so a 10,000-step run at
94 x 256 is read in seconds with a bounded amount of memory. Later records win when a resumed
run logged a step twice; a torn last line from a crash is skipped with a warning.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics import metric_names as mn
from nemo_moe_metrics.moe.timeline import DeadStreaks, Drift, Streak

HEATMAP_FILE = "expert_load_heatmap.png"
OVER_STEPS_FILE = "expert_load_over_steps.png"
DRIFT_FILE = "routing_drift.png"
MAX_OVER_IDEAL_FILE = "max_over_ideal.png"
DEFAULT_DEAD_STEPS = 10
DEFAULT_WORST_LAYERS = 4
_METRICS_FILE = "metrics.jsonl"
_RUN_FILE = "run.json"
_LAYER_MOI = re.compile(r"^moe/layer_(\d+)/max_over_ideal$")
_DPI = 110
# The over-steps picture keeps at most this many step bins (tokens summed within a bin) ...
_MAX_BINS = 512
# ... and at most this much memory for them, whatever the model's shape.
_BIN_BYTES = 256 << 20
# Last values (throughput, aux losses) are looked for in this many final logged steps.
_LAST_LOOKBACK = 20

Window = tuple[int | None, int | None]


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says what is missing."""


# --- metrics.jsonl: streamed, only the numbers the summary needs --------------------------------

_STEP_PREFIX = b'{"step":'
_TABLE_KEY = ('"' + mn.EXPERT_LOADS + '":').encode()


def _number(line: bytes, key: str) -> float | None:
    """The scalar value of ``key`` in one compact JSONL line (as the JSONL sink writes it)."""
    token = ('"' + key + '":').encode()
    i = line.find(token)
    if i < 0:
        return None
    j = i + len(token)
    end = line.find(b",", j)
    raw = line[j : end if end >= 0 else len(line) - 1].strip()
    return None if raw == b"null" else float(raw)


@dataclass
class _Line:
    step: int
    offset: int  # byte offset of the line in the file
    tokens: float | None
    seconds: float | None
    has_table: bool


def _parse_line(raw: bytes, offset: int) -> _Line:
    """Step, tokens, seconds of one line; ValueError/KeyError/TypeError when it is torn."""
    line = raw.rstrip()
    if not (line.startswith(b"{") and line.endswith(b"}")):
        raise ValueError("not a whole JSON object")
    if line.startswith(_STEP_PREFIX):
        # The JSONL sink's layout: {"step":N,"key":value,...} with no spaces. Finding three
        # keys costs microseconds where json.loads of a 1,000-key line costs a millisecond.
        comma = line.find(b",")
        step = int(line[len(_STEP_PREFIX) : comma if comma >= 0 else len(line) - 1])
        return _Line(
            step,
            offset,
            _number(line, mn.TOKENS),
            _number(line, mn.SECONDS),
            _TABLE_KEY in line,
        )
    record = json.loads(line)  # written by something else: parse it properly
    return _Line(
        int(record["step"]),
        offset,
        record.get(mn.TOKENS),
        record.get(mn.SECONDS),
        mn.EXPERT_LOADS in record,
    )


def _drop_restarted(records: list[Any], step: int) -> None:
    # A step that goes back means the run restarted from a checkpoint: the records logged at
    # or after that step before the restart belong to an abandoned timeline.
    while records and records[-1].step >= step:
        records.pop()


def _in_window(step: int, window: Window | None) -> bool:
    return window is None or (
        (window[0] is None or step >= window[0]) and (window[1] is None or step <= window[1])
    )


def _window_text(window: Window) -> str:
    return f"{'' if window[0] is None else window[0]}:{'' if window[1] is None else window[1]}"


def _scan_jsonl(path: Path, window: Window | None) -> tuple[list[_Line], tuple[int, int] | None]:
    """The logged steps of the run as it finally went, restricted to the window, and the
    first/last step of the whole log."""
    lines: list[_Line] = []
    torn = 0
    offset = 0
    with path.open("rb") as f:
        for raw in f:
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                line = _parse_line(raw, start)
            except (ValueError, KeyError, TypeError):
                torn += 1  # a line cut short by a crash; every completed line is still good
                continue
            _drop_restarted(lines, line.step)
            lines.append(line)
    if torn:
        warnings.warn(f"{path}: skipped {torn} unreadable line(s) (torn by a crash?)", stacklevel=3)
    seen = (lines[0].step, lines[-1].step) if lines else None
    return [ln for ln in lines if _in_window(ln.step, window)], seen


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every step record of a JSONL file, parsed, in step order, as the run finally went.

    When a resumed run logs a step at or below one already in the file, the earlier records
    from that step on are dropped (they belong to the timeline abandoned by the restart).
    A torn line (crash mid-write) is skipped with one warning.
    """
    path = Path(path)
    lines, _ = _scan_jsonl(path, None)
    with path.open("rb") as f:
        return [_read_line(f, line) for line in lines]


def _read_line(f: Any, line: _Line) -> dict[str, Any]:
    f.seek(line.offset)
    return json.loads(f.readline())


def _last_values(path: Path, lines: list[_Line], keys: list[str]) -> dict[str, float]:
    """Each key's last non-null value among the final logged steps of the window."""
    out: dict[str, float] = {}
    with path.open("rb") as f:
        for line in reversed(lines[-_LAST_LOOKBACK:]):
            f.seek(line.offset)
            raw = f.readline().rstrip()
            for key in keys:
                if key in out:
                    continue
                if raw.startswith(_STEP_PREFIX):
                    value = _number(raw, key)
                else:
                    value = json.loads(raw).get(key)
                if value is not None:
                    out[key] = float(value)
            if len(out) == len(keys):
                break
    return out


# --- expert counts over steps ------------------------------------------------------------------


class _Bins:
    """Step bins of summed counts ``[bins, L, E]`` for a run of unknown length: when the bins
    are full, neighbours merge pairwise and each bin covers twice as many logged steps."""

    def __init__(self, shape: tuple[int, int]) -> None:
        cells = max(1, shape[0] * shape[1])
        n = int(min(_MAX_BINS, max(16, _BIN_BYTES // (8 * cells))))
        self.n = n - n % 2
        self.sums = np.zeros((self.n, *shape), dtype=np.int64)
        self.first = np.zeros(self.n, dtype=np.int64)
        self.last = np.zeros(self.n, dtype=np.int64)
        self.size = np.zeros(self.n, dtype=np.int64)
        self.used = 0
        self.width = 1  # logged steps per bin

    def add(self, step: int, counts: np.ndarray) -> None:
        if self.used and self.size[self.used - 1] < self.width:
            i = self.used - 1
            self.sums[i] += counts
        else:
            if self.used == self.n:
                self._halve()
            i = self.used
            self.used += 1
            self.sums[i] = counts
            self.first[i] = step
            self.size[i] = 0
        self.last[i] = step
        self.size[i] += 1

    def _halve(self) -> None:
        h = self.n // 2
        self.sums[:h] = self.sums[0::2] + self.sums[1::2]
        self.first[:h] = self.first[0::2]
        self.last[:h] = self.last[1::2]
        self.size[:h] = self.size[0::2] + self.size[1::2]
        self.used = h
        self.width *= 2


@dataclass
class _Timeline:
    """What the report draws from the expert counts, accumulated one logged step at a time."""

    keep_sum: bool
    dead_steps: int
    layer_ids: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    moi: list[np.ndarray] = field(default_factory=list)  # per step: [L] max/ideal (NaN: empty)
    drift: list[np.ndarray] = field(default_factory=list)  # per step after the first: [L]
    heat: np.ndarray | None = None  # the last step's counts, or the window's sum
    bins: _Bins | None = None
    streaks: DeadStreaks | None = None
    _drift: Drift = field(default_factory=Drift)

    def add(self, step: int, layer_ids: Any, counts: np.ndarray) -> None:
        ids = [int(la) for la in layer_ids]
        order = np.argsort(ids, kind="stable")
        if not np.array_equal(order, np.arange(len(ids))):
            ids = [ids[i] for i in order]
            counts = counts[order]
        if not self.steps:
            self.layer_ids = ids
            self.bins = _Bins(counts.shape)
            self.streaks = DeadStreaks(self.dead_steps)
        elif ids != self.layer_ids or self.heat is None or counts.shape != self.heat.shape:
            raise ReportError(
                f"step {step} has MoE layers {ids} x {counts.shape[1]} experts but step "
                f"{self.steps[0]} had {self.layer_ids} x {self.heat.shape[1]}; the model changed "
                "within the run: report each part on its own with --steps FIRST:LAST"
            )
        totals = counts.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.moi.append(counts.max(axis=1) * counts.shape[1] / totals)
        js = self._drift.update(counts)
        if self.steps:
            self.drift.append(js)
        if self.keep_sum and self.heat is not None:
            self.heat += counts
        else:
            self.heat = counts.astype(np.int64, copy=self.keep_sum)
        assert self.bins is not None and self.streaks is not None
        self.bins.add(step, counts)
        self.streaks.update(step, ids, counts)
        self.steps.append(int(step))


def _store_counts(
    run_dir: Path, window: Window | None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]] | None:
    from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

    path = store_path(run_dir)
    if not path.is_file():
        return None
    lo, hi = window if window is not None else (None, None)
    return read_expert_loads(path, slice(lo, None if hi is None else hi + 1))


def _store_has_steps(run_dir: Path) -> bool:
    from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

    path = store_path(run_dir)
    return path.is_file() and next(read_expert_loads(path), None) is not None


def _jsonl_table_counts(
    path: Path, lines: list[_Line], num_experts: int | None
) -> Iterator[tuple[int, list[int], np.ndarray]]:
    """Counts from ``moe/expert_loads`` rows: the JSONL of runs from before the store."""
    from nemo_moe_metrics.sinks.store import table_to_counts

    with path.open("rb") as f:
        for line in lines:
            if not line.has_table:
                continue
            rows = _read_line(f, line).get(mn.EXPERT_LOADS)
            if not rows:
                continue
            layer_ids, counts = table_to_counts(rows)
            if num_experts and counts.shape[1] < num_experts:
                counts = np.pad(counts, ((0, 0), (0, num_experts - counts.shape[1])))
            yield line.step, layer_ids, counts


def _layer_key_series(path: Path, lines: list[_Line]) -> tuple[list[int], dict[int, list[float]]]:
    """Per-layer max/ideal from ``moe/layer_{i}/max_over_ideal`` keys (runs without counts)."""
    steps: list[int] = []
    series: dict[int, list[float]] = {}
    with path.open("rb") as f:
        for line in lines:
            values = {
                int(m.group(1)): float(v)
                for k, v in _read_line(f, line).items()
                if (m := _LAYER_MOI.match(k)) and v is not None
            }
            if not values:
                continue
            steps.append(line.step)
            for layer, v in values.items():
                series.setdefault(layer, [math.nan] * (len(steps) - 1)).append(v)
            for vs in series.values():
                if len(vs) < len(steps):
                    vs.append(math.nan)
    return steps, dict(sorted(series.items()))


# --- pictures ----------------------------------------------------------------------------------


def _steps_label(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}–{steps[-1]} ({len(steps)} logged, tokens summed)"


def _ratio_label(exp: float) -> str:
    if exp >= 0:
        return f"×{2**exp:g}"
    return f"×1/{2 ** (-exp):g}"


def _log_ratio(counts: np.ndarray) -> tuple[np.ndarray, np.ma.MaskedArray]:
    """Load / ideal over the last axis and its log2, masked where an expert got no token."""
    totals = counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = counts * counts.shape[-1] / totals
        log_ratio = np.log2(ratio)
    return ratio, np.ma.masked_array(log_ratio, mask=(counts == 0) | ~np.isfinite(log_ratio))


def _worst(shown: np.ma.MaskedArray) -> float:
    """The largest |log2 ratio| of a picture (0 when every cell is masked)."""
    return float(np.abs(shown).max()) if shown.count() else 0.0


def _colour_limit(heat: np.ma.MaskedArray, over_steps: np.ma.MaskedArray) -> float:
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


def _render_heatmap(
    run: _RunInfo,
    path: Path,
    layer_ids: list[int],
    counts: np.ndarray,
    steps: list[int],
    lim: float,
) -> None:
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    n_layers, n_experts = counts.shape
    ratio, shown = _log_ratio(counts)
    dead = counts == 0
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
            if np.isfinite(v):
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
    ax.set_title(
        f"{run.model_label(n_layers, n_experts)}\nexpert load / ideal, "
        f"{_steps_label(steps)}{dead_note}",
        fontsize=10,
        loc="left",
    )
    fig.savefig(path)


def _bin_ratios(bins: _Bins, rows: list[int]) -> tuple[np.ndarray, np.ma.MaskedArray]:
    """[len(rows), experts, bins] log2 load/ideal of the chosen layer rows, per step bin."""
    sums = bins.sums[: bins.used][:, rows, :]  # [bins, layers, E]
    _, shown = _log_ratio(sums)
    return sums, np.ma.transpose(shown, (1, 2, 0))


def _render_over_steps(
    run: _RunInfo,
    path: Path,
    timeline: _Timeline,
    rows: list[int],
    shown: np.ma.MaskedArray,
    lim: float,
    why: str,
) -> None:
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    bins = timeline.bins
    assert bins is not None
    n_experts = shown.shape[1]
    # Bin edges on the step axis: each bin spans its first to its last logged step.
    edges = np.append(bins.first[: bins.used], bins.last[bins.used - 1] + 1).astype(float)
    panel = min(max(n_experts / 64, 1.6), 3.2)
    height = panel * len(rows) + 1.4
    fig = Figure(figsize=(11, height), dpi=_DPI, layout="constrained")
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    worst = _worst(shown)
    moi = np.asarray(timeline.moi)
    image = None
    for ax, row, data in zip(axes, rows, shown, strict=True):
        image = ax.pcolormesh(
            edges,
            np.arange(n_experts + 1) - 0.5,
            data,
            cmap=_colour_map(),
            norm=Normalize(-lim, lim),
            shading="flat",
        )
        ax.set_ylim(n_experts - 0.5, -0.5)  # expert 0 on top, as in the heatmap
        mean = np.nanmean(moi[:, row])
        ax.set_ylabel(f"layer {timeline.layer_ids[row]}: expert\n(mean max/ideal {mean:.2f})")
    axes[-1].set_xlabel("training step")
    _colour_bar(fig, image, list(axes), lim, worst, 2.5 * height)
    per_bin = (
        "one column per logged step"
        if bins.width == 1
        else f"each column sums the tokens of {bins.width} logged steps"
    )
    dead = "; black = 0 tokens" if np.ma.getmaskarray(shown).any() else ""
    axes[0].set_title(
        f"{run.model_label(len(timeline.layer_ids), n_experts)}\nexpert load / ideal over "
        f"steps {timeline.steps[0]}–{timeline.steps[-1]}, {why}; {per_bin}{dead}",
        fontsize=10,
        loc="left",
    )
    fig.savefig(path)


def _nice_stride(n: int, max_ticks: int) -> int:
    stride = 1
    while n / stride > max_ticks:
        stride *= 2
    return stride


def _render_layer_series(
    run: _RunInfo,
    path: Path,
    steps: list[int],
    series: dict[int, np.ndarray],
    *,
    ylabel: str,
    title: str,
    ideal: float | None,
) -> None:
    """One line per layer over steps: many layers as a band, the worst in red, the mean black."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    marker = "o" if len(steps) <= 20 else None
    layers = list(series)
    values = np.array([series[la] for la in layers], dtype=np.float64)  # [layers, steps]
    many = len(layers) > 10
    cmap = colormaps["viridis"]
    norm = Normalize(min(layers), max(max(layers), min(layers) + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: empty steps
        low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
        mean = np.nanmean(values, axis=0)
        layer_means = np.nanmean(values, axis=1)
    worst = layers[int(np.nanargmax(np.where(np.isnan(layer_means), -np.inf, layer_means)))]
    if many:
        # Many layers: a min-max band and faint lines, the worst layer picked out in red.
        ax.fill_between(steps, low, high, color="tab:blue", alpha=0.12, label="range over layers")
    for layer, vs in zip(layers, values, strict=True):
        highlight = many and layer == worst
        ax.plot(
            steps,
            vs,
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
    ax.legend(fontsize=8, loc="upper right", ncols=2 if len(layers) > 5 else 1)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_title(f"{run.name}: {title}", fontsize=10, loc="left")
    fig.savefig(path)


# --- the report --------------------------------------------------------------------------------


@dataclass
class _RunInfo:
    name: str
    num_experts: int | None = None
    topk: int | None = None

    def model_label(self, n_layers: int, n_experts: int) -> str:
        topk = f", top-{self.topk}" if self.topk else ""
        return f"{self.name}: {n_layers} MoE layers × {n_experts} experts{topk}"


def _run_info(run_dir: Path) -> _RunInfo:
    meta: dict[str, Any] = {}
    if (run_dir / _RUN_FILE).is_file():
        try:
            meta = json.loads((run_dir / _RUN_FILE).read_text(encoding="utf-8"))
        except ValueError as err:
            # Metadata only adds the run name and expert count; the JSONL alone is enough.
            warnings.warn(
                f"{run_dir / _RUN_FILE} is not valid JSON ({err}); ignoring it", stacklevel=3
            )
    return _RunInfo(
        name=str(meta.get("run_name") or run_dir.resolve().name),
        num_experts=meta.get("num_experts"),
        topk=meta.get("moe_router_topk"),
    )


def _max_over_ideal(counts: np.ndarray) -> float:
    total = counts.sum()
    return float(counts.max() * counts.size / total) if total > 0 else 0.0


def _by_layer(pairs: list[tuple[int, str]], limit: int = 5) -> str:
    grouped: dict[int, list[str]] = {}
    for layer, text in pairs:
        grouped.setdefault(layer, []).append(text)
    shown = "; ".join(f"layer {la}: {', '.join(ts)}" for la, ts in list(grouped.items())[:limit])
    return shown + (f"; ... ({len(grouped) - limit} more layers)" if len(grouped) > limit else "")


def _streak_lines(streaks: list[Streak], n: int) -> list[str]:
    head = f"dead-expert streaks (0 tokens for >= {n} consecutive logged steps, --dead-steps {n})"
    if not streaks:
        return [f"{head}: none"]
    layers = len({s.layer for s in streaks})
    pairs = [
        (
            s.layer,
            f"expert {s.expert} steps {s.first}–{s.last} ({s.length} logged"
            + (", to the end)" if s.ongoing else ")"),
        )
        for s in sorted(streaks, key=lambda s: (s.layer, -s.length, s.expert))
    ]
    return [f"{head}: {len(streaks)} in {layers} layer(s) — {_by_layer(pairs)}"]


def _drift_lines(timeline: _Timeline) -> list[str]:
    drift = np.asarray(timeline.drift)  # [steps - 1, L]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        per_layer = np.nanmean(drift, axis=0)
        mean = float(np.nanmean(drift))
    if not np.isfinite(mean):
        return ["routing drift: no two consecutive logged steps routed tokens"]
    flat = np.where(np.isfinite(drift), drift, -1.0)
    i, row = np.unravel_index(int(flat.argmax()), flat.shape)
    order = [r for r in np.argsort(np.where(np.isfinite(per_layer), per_layer, -1.0))[::-1][:3]]
    top = ", ".join(f"layer {timeline.layer_ids[r]} {per_layer[r]:.4f}" for r in order)
    return [
        "routing drift (Jensen-Shannon divergence between consecutive logged steps, bits): "
        f"mean {mean:.4f}; largest {drift[i, row]:.4f} at layer {timeline.layer_ids[row]} "
        f"step {timeline.steps[i + 1]} (from step {timeline.steps[i]}); most drifting layers "
        f"(mean): {top}"
    ]


def _choose_layers(
    timeline: _Timeline, layers: list[int] | None, count: int
) -> tuple[list[int], str]:
    """Rows of the layers for the over-steps picture and the words for how they were chosen."""
    if layers:
        unknown = sorted(set(layers) - set(timeline.layer_ids))
        if unknown:
            raise ReportError(
                f"--layers {','.join(map(str, layers))}: no MoE layer {unknown} in the run; its "
                f"MoE layers are {timeline.layer_ids}"
            )
        return [timeline.layer_ids.index(la) for la in layers], "layers asked for (--layers)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = np.nanmean(np.asarray(timeline.moi), axis=0)
    order = np.argsort(np.where(np.isfinite(means), means, -np.inf))[::-1][:count]
    return sorted(int(r) for r in order), f"the {len(order)} worst layers by mean max/ideal"


def render_report(
    run_dir: Path,
    *,
    steps: Window | None = None,
    out_dir: Path | None = None,
    layers: list[int] | None = None,
    dead_steps: int = DEFAULT_DEAD_STEPS,
) -> str:
    """Write the report's PNGs into ``out_dir`` (default: ``run_dir``); return the summary.

    ``steps=(first, last)`` (inclusive; either end None for an open window) restricts
    everything to that window of steps. ``layers`` picks the layers of the over-steps picture
    (default: the worst by mean max/ideal); ``dead_steps`` is the shortest dead-expert streak
    the summary lists. Pictures that the run has no data for are skipped and the summary says
    which flag would produce them.
    """
    from nemo_moe_metrics.extras import check_extra

    check_extra("report", "the report's pictures")
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    path = run_dir / _METRICS_FILE
    if not path.is_file():
        raise ReportError(
            f"{path} not found; point the report at a run directory written with "
            "logger.jsonl_enabled=true"
        )
    if steps is not None and None not in steps and steps[0] > steps[1]:
        raise ReportError(
            f"step window {_window_text(steps)} is empty; give FIRST:LAST with FIRST <= LAST"
        )
    if dead_steps < 1:
        raise ReportError(f"--dead-steps {dead_steps}: a streak is at least 1 logged step")
    run = _run_info(run_dir)
    lines_, seen = _scan_jsonl(path, steps)
    if seen is None:
        raise ReportError(f"{path} holds no step records yet")
    if not lines_:
        assert steps is not None
        raise ReportError(
            f"no logged step in {_window_text(steps)}; the log has steps {seen[0]}..{seen[1]}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    first, last = lines_[0].step, lines_[-1].step
    span = f"step {first}" if first == last else f"steps {first}–{last} ({len(lines_)} logged)"
    out = [f"run {run.name}: {span}"]

    source = _store_counts(run_dir, steps)
    if source is None:
        source = _jsonl_table_counts(path, lines_, run.num_experts)
    timeline = _Timeline(keep_sum=steps is not None, dead_steps=dead_steps)
    for step, layer_ids, counts in source:
        timeline.add(step, layer_ids, counts)

    if timeline.steps:
        out += _count_pictures(run, timeline, out_dir, layers)
    elif steps is not None and _store_has_steps(run_dir):
        out.append(
            f"no stored expert-load step in {span} (the store holds a table every "
            f"logger.table_every steps): {HEATMAP_FILE}, {OVER_STEPS_FILE}, {DRIFT_FILE} and "
            f"{MAX_OVER_IDEAL_FILE} skipped; widen --steps"
        )
    else:
        out.append(
            "no expert-load counts in the run (no expert_loads.bin, no moe/expert_loads rows): "
            f"{HEATMAP_FILE}, {OVER_STEPS_FILE} and {DRIFT_FILE} skipped; log them with "
            "policy.megatron_cfg.track_moe_metrics=true and log_expert_table=true"
        )
        dead_last = _last_values(path, lines_, [mn.DEAD_EXPERTS]).get(mn.DEAD_EXPERTS)
        if dead_last is not None:
            out.append(f"dead experts (last step, {mn.DEAD_EXPERTS}): {dead_last:g}")
        key_steps, key_series = _layer_key_series(path, lines_)
        if key_series:
            _render_layer_series(
                run,
                out_dir / MAX_OVER_IDEAL_FILE,
                key_steps,
                {la: np.asarray(v) for la, v in key_series.items()},
                ylabel="busiest expert's load / ideal  (1 = balanced)",
                title="worst-expert load per layer",
                ideal=1.0,
            )
            out.append(f"wrote {out_dir / MAX_OVER_IDEAL_FILE}")
        else:
            out.append(
                f"no per-layer expert-load data: {MAX_OVER_IDEAL_FILE} skipped; log it with "
                "policy.megatron_cfg.moe_per_layer_logging=true or log_expert_table=true"
            )

    last_keys = [mn.TOKENS_PER_SECOND, mn.TFLOPS_PER_GPU, mn.MFU]
    aux_keys = [mn.aux_loss_key(n) for n in (*mn.AUX_LOSS_TRACKER_NAMES.values(), mn.Z_LOSS)]
    values = _last_values(path, lines_, last_keys + aux_keys)
    out += _throughput_lines(lines_, values)
    aux = [f"{k} {values[k]:.4g}" for k in aux_keys if k in values]
    if aux:
        out.append("aux losses (last step): " + ", ".join(aux))
    else:
        out.append("aux losses: not logged; enable policy.megatron_cfg.track_moe_metrics=true")
    return "\n".join(out)


def _count_pictures(
    run: _RunInfo, timeline: _Timeline, out_dir: Path, layers: list[int] | None
) -> list[str]:
    out: list[str] = []
    layer_ids, counts = timeline.layer_ids, timeline.heat
    assert counts is not None
    heat_steps = timeline.steps if timeline.keep_sum else timeline.steps[-1:]
    per_layer = [_max_over_ideal(c) for c in counts]
    order = np.argsort(per_layer)[::-1][:3]
    worst = ", ".join(f"layer {layer_ids[i]} {per_layer[i]:.2f}" for i in order)
    out.append(
        f"expert load over {_steps_label(heat_steps)}: max/ideal mean "
        f"{np.mean(per_layer):.2f} over {len(layer_ids)} MoE layers; worst: {worst}"
    )
    span = (
        f"step {heat_steps[0]}"
        if len(heat_steps) == 1
        else f"steps {heat_steps[0]}–{heat_steps[-1]}"
    )
    dead = [(layer_ids[r], int(e)) for r, e in zip(*np.nonzero(counts == 0), strict=True)]
    if dead:
        by_layer: dict[int, list[int]] = {}
        for layer, e in dead:
            by_layer.setdefault(layer, []).append(e)
        shown = "; ".join(f"layer {la}: {es}" for la, es in list(by_layer.items())[:5])
        more = " ..." if len(by_layer) > 5 else ""
        out.append(f"dead experts (0 tokens, {span}): {len(dead)} — {shown}{more}")
    else:
        out.append(f"dead experts (0 tokens, {span}): none")
    assert timeline.streaks is not None
    out += _streak_lines(timeline.streaks.streaks(), timeline.dead_steps)
    several = len(timeline.steps) > 1
    if several:
        out += _drift_lines(timeline)

    # One colour scale for the heatmap and the over-steps picture, so they can be compared.
    _, heat_shown = _log_ratio(counts)
    rows, why = _choose_layers(timeline, layers, DEFAULT_WORST_LAYERS)
    assert timeline.bins is not None
    _, over_shown = _bin_ratios(timeline.bins, rows) if several else (None, np.ma.masked_all(0))
    limit = _colour_limit(heat_shown, over_shown)
    _render_heatmap(run, out_dir / HEATMAP_FILE, layer_ids, counts, heat_steps, limit)
    out.append(f"wrote {out_dir / HEATMAP_FILE}")
    if several:
        _render_over_steps(run, out_dir / OVER_STEPS_FILE, timeline, rows, over_shown, limit, why)
        out.append(
            f"wrote {out_dir / OVER_STEPS_FILE} (layers "
            f"{', '.join(str(timeline.layer_ids[r]) for r in rows)}: {why})"
        )
        drift = np.asarray(timeline.drift)
        _render_layer_series(
            run,
            out_dir / DRIFT_FILE,
            timeline.steps[1:],
            {la: drift[:, i] for i, la in enumerate(layer_ids)},
            ylabel="Jensen-Shannon divergence from the previous logged step (bits)",
            title="routing drift per layer (0 = the router's shares did not change)",
            ideal=None,
        )
        out.append(f"wrote {out_dir / DRIFT_FILE}")
    else:
        out.append(
            f"only 1 logged step with expert counts: {OVER_STEPS_FILE} and {DRIFT_FILE} skipped; "
            "they need 2 or more: widen --steps (or log the table more often with "
            "logger.table_every)"
        )
    moi = np.asarray(timeline.moi)
    _render_layer_series(
        run,
        out_dir / MAX_OVER_IDEAL_FILE,
        timeline.steps,
        {la: moi[:, i] for i, la in enumerate(layer_ids)},
        ylabel="busiest expert's load / ideal  (1 = balanced)",
        title=f"worst-expert load per layer ({counts.shape[1]} experts)",
        ideal=1.0,
    )
    out.append(f"wrote {out_dir / MAX_OVER_IDEAL_FILE}")
    return out


def _throughput_lines(lines: list[_Line], values: dict[str, float]) -> list[str]:
    tps = values.get(mn.TOKENS_PER_SECOND)
    if tps is None:
        return ["throughput: not logged; enable policy.megatron_cfg.track_throughput=true"]
    tokens = sum(ln.tokens or 0 for ln in lines)
    seconds = sum(ln.seconds or 0 for ln in lines)
    window = f"; window {tokens / seconds:,.0f} tokens/s (ratio of sums)" if seconds > 0 else ""
    out = [f"throughput: last step {tps:,.0f} tokens/s{window}"]
    perf = []
    tflops = values.get(mn.TFLOPS_PER_GPU)
    if tflops is not None:
        # A tiny CPU model runs at GFLOP/s: three significant digits, not "0.0".
        perf.append(f"{tflops:.3g} TFLOP/s per GPU")
    mfu = values.get(mn.MFU)
    if mfu is not None:
        perf.append(f"MFU {mfu:.1%}")
    elif tflops is not None:
        perf.append(
            "MFU not logged (unknown accelerator peak; set policy.megatron_cfg.peak_flops_per_gpu)"
        )
    if perf:
        out.append("compute (last step): " + ", ".join(perf))
    else:
        out.append("compute: not logged; enable policy.megatron_cfg.track_flops=true")
    return out
