"""The aux-loss-free balancing part of the report: the expert bias next to the load.

Reads ``moe/layer_{i}/expert_bias_range`` and ``moe/layer_{i}/max_over_ideal`` (logged with
``moe_per_layer_logging``) and the means ``moe/expert_bias_range`` / ``moe/expert_bias_update``;
draws, for the worst layers by mean max/ideal, the load (left) next to the bias range (right)
over steps, so a balanced load bought with an ever-growing bias shows at a glance.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report.pictures import save_figure
from nemo_moe_metrics.report.reading import Line, RunInfo, last_values, read_line
from nemo_moe_metrics.run_dir.names import BIAS_FILE  # every picture's name: run_dir.names.PICTURES

_LAYER_KEY = re.compile(r"^moe/layer_(\d+)/(max_over_ideal|expert_bias_range)$")


def layer_series(path: Path, lines: list[Line]) -> tuple[list[int], dict[str, dict[int, list]]]:
    """Steps and per-layer series of max/ideal and bias range (NaN where a step lacks one)."""
    steps: list[int] = []
    series: dict[str, dict[int, list[float]]] = {"max_over_ideal": {}, "expert_bias_range": {}}
    with path.open("rb") as f:
        for line in lines:
            found = [
                (m.group(2), int(m.group(1)), float(v))
                for k, v in read_line(f, line).items()
                if (m := _LAYER_KEY.match(k)) and v is not None
            ]
            if not any(stat == "expert_bias_range" for stat, _, _ in found):
                continue
            steps.append(line.step)
            for stat, layer, v in found:
                series[stat].setdefault(layer, [math.nan] * (len(steps) - 1)).append(v)
            for by_layer in series.values():
                for vs in by_layer.values():
                    if len(vs) < len(steps):
                        vs.append(math.nan)
    return steps, series


def worst_layers(load: dict[int, list[float]], bias: dict[int, list[float]], n: int) -> list[int]:
    """The ``n`` biased layers with the highest mean max/ideal (by bias range without loads)."""
    layers = sorted(bias)
    score = {la: np.nanmean(load[la]) if la in load else np.nanmean(bias[la]) for la in layers}
    return sorted(sorted(layers, key=lambda la: -np.nan_to_num(score[la], nan=-np.inf))[:n])


def render_bias_next_to_load(
    run: RunInfo, path: Path, steps: list[int], series: dict[str, dict[int, list]], rows: list[int]
) -> None:
    """Two panels sharing the step axis: max/ideal (left) and bias range (right) per layer."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.5), dpi=110, layout="constrained")
    load_ax, bias_ax = fig.subplots(1, 2, sharex=True)
    cmap = colormaps["tab10"]
    marker = "o" if len(steps) <= 20 else None
    for i, layer in enumerate(rows):
        colour = cmap(i % 10)
        if layer in series["max_over_ideal"]:
            load_ax.plot(steps, series["max_over_ideal"][layer], color=colour, marker=marker,
                         ms=3, label=f"layer {layer}")  # fmt: skip
        bias_ax.plot(steps, series["expert_bias_range"][layer], color=colour, marker=marker,
                     ms=3, label=f"layer {layer}")  # fmt: skip
    load_ax.axhline(1.0, color="grey", ls="--", lw=1, label="ideal")
    load_ax.set_ylabel("busiest expert's load / ideal")
    load_ax.set_title(f"{run.name}: load of the worst layers", fontsize=10, loc="left")
    bias_ax.set_ylabel("expert bias max - min (score units)")
    bias_ax.set_title("aux-loss-free expert bias range, same layers", fontsize=10, loc="left")
    for ax in (load_ax, bias_ax):
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def bias_report_lines(run: RunInfo, path: Path, lines: list[Line], out_dir: Path) -> list[str]:
    """The summary lines (and the picture) for runs with an expert bias; [] for the others."""
    last = last_values(path, lines, [mn.EXPERT_BIAS_RANGE, mn.EXPERT_BIAS_UPDATE])
    if mn.EXPERT_BIAS_RANGE not in last:
        return []
    out = [
        f"expert bias (aux-loss-free balancing, last step): range mean "
        f"{last[mn.EXPERT_BIAS_RANGE]:.4g}, update mean {last.get(mn.EXPERT_BIAS_UPDATE, 0.0):.4g}"
    ]
    steps, series = layer_series(path, lines)
    if not series["expert_bias_range"]:
        out.append(f"no per-layer expert bias: {BIAS_FILE} skipped; log it with "
                   "moe_per_layer_logging=true")  # fmt: skip
        return out
    rows = worst_layers(series["max_over_ideal"], series["expert_bias_range"], 4)
    shown = []
    for layer in rows:
        load = series["max_over_ideal"].get(layer, [math.nan])[-1]
        shown.append(f"layer {layer} max/ideal {load:.3g} bias range "
                     f"{series['expert_bias_range'][layer][-1]:.4g}")  # fmt: skip
    out.append("worst layers (last step): " + "; ".join(shown))
    render_bias_next_to_load(run, out_dir / BIAS_FILE, steps, series, rows)
    out.append(f"wrote {out_dir / BIAS_FILE}")
    return out
