"""Pictures and a text summary of a run, from its ``metrics.jsonl``, expert-load store and
``run.json``.

``render_report(run_dir)`` writes two PNGs into the run directory and returns the summary:

- ``expert_load_heatmap.png``: MoE layers (rows) x experts (columns); colour is the expert's
  load as a multiple of the ideal (tokens x experts / layer tokens), on a log2 scale centred on
  1: white is balanced, red overloaded, blue underloaded, black an expert that got no token.
  Over a window of steps the tokens are summed first, so the picture is the window's load.
- ``max_over_ideal.png``: each layer's worst-expert load over ideal, step by step.

The scalars come from the JSONL, the expert tables from the store beside it (``expert_loads.bin``;
older runs kept table rows in the JSONL, which is still read); ``run.json`` (written by
``build_sinks``) adds the run name and the expert count. Later lines win when a resumed run logged a step twice; a torn last line from a
crash is skipped with a warning.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics import metric_names as mn
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

HEATMAP_FILE = "expert_load_heatmap.png"
MAX_OVER_IDEAL_FILE = "max_over_ideal.png"
_METRICS_FILE = "metrics.jsonl"
_RUN_FILE = "run.json"
_LAYER_MOI = re.compile(r"^moe/layer_(\d+)/max_over_ideal$")
_DPI = 110


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says what is missing."""


def _iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """Parsed lines in file order; a torn line (crash mid-write) is skipped with one warning."""
    torn = 0
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record["step"] = int(record["step"])
            except (ValueError, KeyError, TypeError):
                torn += 1  # a line cut short by a crash; every completed line is still good
                continue
            yield record
    if torn:
        warnings.warn(f"{path}: skipped {torn} unreadable line(s) (torn by a crash?)", stacklevel=3)


def _drop_restarted(records: list[Any], step: int) -> None:
    # A step that goes back means the run restarted from a checkpoint: the records logged at
    # or after that step before the restart belong to an abandoned timeline.
    while records and records[-1].step >= step:
        records.pop()


@dataclass
class _Record:
    step: int
    data: dict[str, Any]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSONL file in step order, as the run finally went.

    When a resumed run logs a step at or below one already in the file, the earlier records
    from that step on are dropped (they belong to the timeline abandoned by the restart).
    """
    records: list[_Record] = []
    for record in _iter_records(path):
        _drop_restarted(records, record["step"])
        records.append(_Record(record["step"], record))
    return [r.data for r in records]


@dataclass
class _Step:
    step: int
    scalars: dict[str, Any]
    # Per-layer max/ideal computed from this step's table (empty without a table).
    table_moi: dict[int, float]
    # Per-layer token counts, kept only for the steps the heatmap shows.
    counts: dict[int, np.ndarray] | None


@dataclass
class _Run:
    name: str
    records: list[_Step]
    num_experts: int | None = None
    topk: int | None = None

    @property
    def tables(self) -> dict[int, dict[int, np.ndarray]]:
        """step -> {layer: tokens per expert} for the steps the heatmap covers."""
        return {r.step: r.counts for r in self.records if r.counts is not None}


def _table_counts(rows: list[list], num_experts: int | None) -> dict[int, np.ndarray]:
    width = max([int(num_experts or 0)] + [int(row[1]) + 1 for row in rows])
    layers: dict[int, np.ndarray] = {}
    for layer, expert, tokens, _pct in rows:
        counts = layers.setdefault(int(layer), np.zeros(width, dtype=np.int64))
        counts[int(expert)] += int(tokens)
    return layers


def _load_run(run_dir: Path, steps: tuple[int, int] | None) -> _Run:
    """Stream the JSONL once; keep scalars per step but tables only where the heatmap needs them.

    A long run's JSONL can hold gigabytes of tables; only the last table (or the window's) is
    kept as counts, every other table is reduced to its per-layer max/ideal on the fly.
    """
    run_dir = Path(run_dir)
    path = run_dir / _METRICS_FILE
    if not path.is_file():
        raise ReportError(
            f"{path} not found; point the report at a run directory written with "
            "logger.jsonl_enabled=true"
        )
    if steps is not None and steps[0] > steps[1]:
        raise ReportError(
            f"step window {steps[0]}:{steps[1]} is empty; give FIRST:LAST with FIRST <= LAST"
        )
    meta: dict[str, Any] = {}
    if (run_dir / _RUN_FILE).is_file():
        try:
            meta = json.loads((run_dir / _RUN_FILE).read_text(encoding="utf-8"))
        except ValueError as err:
            # Metadata only adds the run name and expert count; the JSONL alone is enough.
            warnings.warn(
                f"{run_dir / _RUN_FILE} is not valid JSON ({err}); ignoring it", stacklevel=2
            )
    num_experts = meta.get("num_experts")

    records: list[_Step] = []
    seen: list[int] = []
    holder: _Step | None = None  # without a window, the one step whose counts are kept
    for record in _iter_records(path):
        step = record.pop("step")
        _drop_restarted(records, step)
        seen = [min(seen[0], step), max(seen[1], step)] if seen else [step, step]
        if steps is not None and not steps[0] <= step <= steps[1]:
            continue
        rows = record.pop(mn.EXPERT_LOADS, None)
        counts = _table_counts(rows, num_experts) if rows else None
        moi = {la: _max_over_ideal(c) for la, c in counts.items()} if counts else {}
        entry = _Step(step, record, moi, counts)
        if counts is not None and steps is None:
            if holder is not None:
                holder.counts = None
            holder = entry
        records.append(entry)
    _attach_store_counts(run_dir, records, steps)
    if not seen:
        raise ReportError(f"{path} holds no step records yet")
    if not records:
        raise ReportError(
            f"no logged step in {steps[0]}:{steps[1]}; the log has steps {seen[0]}..{seen[1]}"
        )
    return _Run(
        name=str(meta.get("run_name") or run_dir.resolve().name),
        records=records,
        num_experts=num_experts,
        topk=meta.get("moe_router_topk"),
    )


def _attach_store_counts(
    run_dir: Path, records: list[_Step], steps: tuple[int, int] | None
) -> None:
    """Tables from the expert-load store (runs since the store; older runs kept table rows in
    the JSONL, read above). Without a window only the last stored step keeps its counts."""
    path = store_path(run_dir)
    if not path.is_file():
        return
    by_step = {r.step: r for r in records}
    window = slice(steps[0], steps[1] + 1) if steps is not None else None
    holder: _Step | None = None
    for step, layer_ids, counts in read_expert_loads(path, window):
        entry = by_step.get(step)
        if entry is None:  # not in the JSONL's final timeline
            continue
        per_layer = {int(la): counts[i] for i, la in enumerate(layer_ids)}
        entry.table_moi = {la: _max_over_ideal(c) for la, c in per_layer.items()}
        entry.counts = per_layer
        if steps is None:
            if holder is not None:
                holder.counts = None
            holder = entry


def _max_over_ideal(counts: np.ndarray) -> float:
    total = counts.sum()
    return float(counts.max() * counts.size / total) if total > 0 else 0.0


def _per_layer_series(run: _Run) -> tuple[list[int], dict[int, list[float]]]:
    """Steps and per-layer max/ideal: from the per-layer keys when logged, else the table."""
    steps: list[int] = []
    series: dict[int, list[float]] = {}
    from_keys = any(_LAYER_MOI.match(k) for r in run.records for k in r.scalars)
    for r in run.records:
        values: dict[int, float] = {}
        if from_keys:
            for k, v in r.scalars.items():
                m = _LAYER_MOI.match(k)
                if m and v is not None:
                    values[int(m.group(1))] = float(v)
        else:
            values = r.table_moi
        if not values:
            continue
        steps.append(r.step)
        for layer, v in values.items():
            series.setdefault(layer, [math.nan] * (len(steps) - 1)).append(v)
        for vs in series.values():
            if len(vs) < len(steps):
                vs.append(math.nan)
    return steps, dict(sorted(series.items()))


def _window_counts(run: _Run) -> tuple[list[int], np.ndarray, list[int]]:
    """MoE layer ids, summed counts [layers, experts] and the steps the table covers."""
    table_steps = sorted(run.tables)
    layer_ids = sorted({la for t in run.tables.values() for la in t})
    width = max(c.size for t in run.tables.values() for c in t.values())
    counts = np.zeros((len(layer_ids), width), dtype=np.int64)
    for t in run.tables.values():
        for row, layer in enumerate(layer_ids):
            if layer in t:
                counts[row, : t[layer].size] += t[layer]
    return layer_ids, counts, table_steps


def _steps_label(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}–{steps[-1]} ({len(steps)} logged, tokens summed)"


def _ratio_label(exp: float) -> str:
    if exp >= 0:
        return f"×{2**exp:g}"
    return f"×1/{2 ** (-exp):g}"


def _render_heatmap(run: _Run, path: Path) -> tuple[list[int], np.ndarray, list[int]]:
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    layer_ids, counts, table_steps = _window_counts(run)
    n_layers, n_experts = counts.shape
    totals = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = counts * n_experts / totals
        log_ratio = np.log2(ratio)
    dead = counts == 0
    shown = np.ma.masked_array(log_ratio, mask=dead | ~np.isfinite(log_ratio))
    worst = float(np.abs(shown).max()) if shown.count() else 0.0
    # Symmetric limits, whole powers of two: white stays exactly "ideal", at least x1/2..x2.
    limit = float(min(max(1, math.ceil(worst - 1e-9)), 5))

    from matplotlib import colormaps

    cmap = colormaps["RdBu_r"].with_extremes(bad="black")
    height = min(max(0.28 * n_layers + 2.2, 3.6), 14.0)
    fig = Figure(figsize=(11, height), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(
        shown,
        cmap=cmap,
        norm=Normalize(-limit, limit),
        aspect="auto",
        interpolation="nearest",
        origin="upper",
    )
    ticks = np.arange(-limit, limit + 1)
    bar = fig.colorbar(
        image,
        ax=ax,
        ticks=ticks,
        extend="both" if worst > limit else "neither",
        pad=0.01,
        aspect=2.5 * height,  # a bar about 0.35 inch wide whatever the figure height
    )
    bar.ax.set_yticklabels([_ratio_label(t) for t in ticks])
    bar.set_label("expert load / ideal  (log scale; white = balanced)")

    ax.set_xlabel(f"expert (0–{n_experts - 1})")
    ax.set_ylabel("MoE layer (global index)")
    x_stride = _nice_stride(n_experts, 16)
    ax.set_xticks(np.arange(0, n_experts, x_stride))
    y_stride = _nice_stride(n_layers, 24)
    rows = np.arange(0, n_layers, y_stride)
    ax.set_yticks(rows, [str(layer_ids[r]) for r in rows])
    if n_layers * n_experts <= 256:
        # Small grids: print each multiple so nobody has to decode colours.
        for (r, e), v in np.ndenumerate(ratio):
            if np.isfinite(v):
                dark = v == 0 or abs(math.log2(v)) > 0.6 * limit
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
        f"{_model_label(run, n_layers, n_experts)}\nexpert load / ideal, {_steps_label(table_steps)}{dead_note}",
        fontsize=10,
        loc="left",
    )
    fig.savefig(path)
    return layer_ids, counts, table_steps


def _nice_stride(n: int, max_ticks: int) -> int:
    stride = 1
    while n / stride > max_ticks:
        stride *= 2
    return stride


def _model_label(run: _Run, n_layers: int, n_experts: int) -> str:
    topk = f", top-{run.topk}" if run.topk else ""
    return f"{run.name}: {n_layers} MoE layers × {n_experts} experts{topk}"


def _render_max_over_ideal(
    run: _Run, path: Path, steps: list[int], series: dict[int, list[float]]
) -> None:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    marker = "o" if len(steps) <= 20 else None
    layers = list(series)
    values = np.array([series[la] for la in layers])  # [layers, steps]
    many = len(layers) > 10
    cmap = colormaps["viridis"]
    norm = Normalize(min(layers), max(max(layers), min(layers) + 1))
    if many:
        # Many layers: a min-max band and faint lines, the worst layer picked out in red.
        ax.fill_between(
            steps,
            np.nanmin(values, axis=0),
            np.nanmax(values, axis=0),
            color="tab:blue",
            alpha=0.12,
            label="range over layers",
        )
        worst = layers[int(np.nanargmax(np.nanmean(values, axis=1)))]
    for layer in layers:
        highlight = many and layer == worst
        ax.plot(
            steps,
            series[layer],
            color="tab:red" if highlight else cmap(norm(layer)),
            lw=2.0 if highlight else 1.0,
            alpha=1.0 if highlight or not many else 0.35,
            marker=marker,
            ms=3,
            zorder=3 if highlight else 2,
            label=(f"worst layer ({layer})" if highlight else None) if many else f"layer {layer}",
        )
    mean = np.nanmean(values, axis=0)
    ax.plot(
        steps,
        mean,
        color="black",
        lw=2.4,
        marker=marker,
        ms=4,
        zorder=4,
        label="mean over MoE layers",
    )
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="ideal (perfect balance)")
    if many:
        fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="MoE layer", pad=0.01)
    ax.legend(fontsize=8, loc="upper right", ncols=2 if len(layers) > 5 else 1)
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert's load / ideal  (1 = balanced)")
    ax.set_ylim(bottom=min(0.95, float(np.nanmin(mean)) - 0.05) if len(steps) else 0)
    ax.grid(alpha=0.3)
    n_experts = max((c.size for t in run.tables.values() for c in t.values()), default=0)
    ax.set_title(
        f"{run.name}: worst-expert load per layer"
        + (f" ({n_experts} experts)" if n_experts else ""),
        fontsize=10,
        loc="left",
    )
    fig.savefig(path)


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    for r in reversed(records):
        if r.get(key) is not None:
            return float(r[key])
    return None


def render_report(run_dir: Path, *, steps: tuple[int, int] | None = None) -> str:
    """Write the heatmap and max/ideal PNGs into ``run_dir``; return the text summary.

    ``steps=(first, last)`` (inclusive) restricts everything to that window of steps.
    Pictures that the log has no data for are skipped and the summary says why.
    """
    run_dir = Path(run_dir)
    run = _load_run(run_dir, steps)
    recs = [{"step": r.step, **r.scalars} for r in run.records]
    first, last = recs[0]["step"], recs[-1]["step"]
    span = f"step {first}" if first == last else f"steps {first}–{last} ({len(recs)} logged)"
    lines = [f"run {run.name}: {span}"]

    if run.tables:
        layer_ids, counts, table_steps = _render_heatmap(run, run_dir / HEATMAP_FILE)
        per_layer = [_max_over_ideal(c) for c in counts]
        order = np.argsort(per_layer)[::-1][:3]
        worst = ", ".join(f"layer {layer_ids[i]} {per_layer[i]:.2f}" for i in order)
        lines.append(
            f"expert load over {_steps_label(table_steps)}: max/ideal mean "
            f"{np.mean(per_layer):.2f} over {len(layer_ids)} MoE layers; worst: {worst}"
        )
        span = (
            f"step {table_steps[0]}"
            if len(table_steps) == 1
            else (f"steps {table_steps[0]}–{table_steps[-1]}")
        )
        dead = [(layer_ids[r], e) for r, e in zip(*np.nonzero(counts == 0), strict=True)]
        if dead:
            by_layer: dict[int, list[int]] = {}
            for layer, e in dead:
                by_layer.setdefault(layer, []).append(int(e))
            shown = "; ".join(f"layer {la}: {es}" for la, es in list(by_layer.items())[:5])
            more = " ..." if len(by_layer) > 5 else ""
            lines.append(f"dead experts (0 tokens, {span}): {len(dead)} — {shown}{more}")
        else:
            lines.append(f"dead experts (0 tokens, {span}): none")
        lines.append(f"wrote {run_dir / HEATMAP_FILE}")
    else:
        lines.append(
            f"no {mn.EXPERT_LOADS} table in the log: heatmap skipped (enable "
            "policy.megatron_cfg.track_moe_metrics and log_expert_table)"
        )
        dead_last = _last(recs, mn.DEAD_EXPERTS)
        if dead_last is not None:
            lines.append(f"dead experts (last step, {mn.DEAD_EXPERTS}): {dead_last:g}")

    series_steps, series = _per_layer_series(run)
    if series:
        _render_max_over_ideal(run, run_dir / MAX_OVER_IDEAL_FILE, series_steps, series)
        lines.append(f"wrote {run_dir / MAX_OVER_IDEAL_FILE}")
    else:
        lines.append("no per-layer expert-load data: max_over_ideal.png skipped")

    lines += _throughput_lines(recs)
    aux = [
        f"{mn.aux_loss_key(n)} {v:.4g}"
        for n in (*mn.AUX_LOSS_TRACKER_NAMES.values(), mn.Z_LOSS)
        if (v := _last(recs, mn.aux_loss_key(n))) is not None
    ]
    if aux:
        lines.append("aux losses (last step): " + ", ".join(aux))
    return "\n".join(lines)


def _throughput_lines(recs: list[dict[str, Any]]) -> list[str]:
    tps = _last(recs, mn.TOKENS_PER_SECOND)
    if tps is None:
        return ["throughput: not logged (policy.megatron_cfg.track_throughput=false?)"]
    tokens = sum(r.get(mn.TOKENS) or 0 for r in recs)
    seconds = sum(r.get(mn.SECONDS) or 0 for r in recs)
    window = f"; window {tokens / seconds:,.0f} tokens/s (ratio of sums)" if seconds > 0 else ""
    out = [f"throughput: last step {tps:,.0f} tokens/s{window}"]
    perf = []
    tflops = _last(recs, mn.TFLOPS_PER_GPU)
    if tflops is not None:
        # A tiny CPU model runs at GFLOP/s: three significant digits, not "0.0".
        perf.append(f"{tflops:.3g} TFLOP/s per GPU")
    mfu = _last(recs, mn.MFU)
    if mfu is not None:
        perf.append(f"MFU {mfu:.1%}")
    if perf:
        out.append("compute (last step): " + ", ".join(perf))
    return out
