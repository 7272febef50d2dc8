"""The router-health part of the report: how confident and fragile the routers' decisions are.

Reads the ``track_router_health`` keys: per layer (``moe/layer_{i}/router_confidence`` and
``.../router_near_tie_fraction``, with ``moe_per_layer_logging``) or the summaries, and the
global and micro-batch max/ideal. Draws ``router_health.png``: confidence and near-tie share per
layer over steps (the layers with the most near ties marked), next to the global-batch and
micro-batch balance; the summary says in one line what a healthy run looks like beside this
run's figures.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report.pictures import layer_colours
from nemo_moe_metrics.report.reading import Line, RunInfo, last_values, read_line
from nemo_moe_metrics.run_dir.names import (
    ROUTER_HEALTH_FILE,
)  # every picture: run_dir.names.PICTURES

_LAYER_KEY = re.compile(r"^moe/layer_(\d+)/(router_confidence|router_near_tie_fraction)$")
_SUMMARIES = (
    mn.ROUTER_CONFIDENCE,
    mn.ROUTER_CONFIDENCE_MIN,
    mn.ROUTER_NEAR_TIE_FRACTION,
    mn.ROUTER_NEAR_TIE_FRACTION_MAX,
    mn.ROUTER_TOPK_RELATIVE_GAP,
    mn.ROUTER_LOGIT_MAX_ABS,
    mn.MAX_OVER_IDEAL,
    mn.MAX_OVER_IDEAL_MICROBATCH,
)


def reference_line(run: RunInfo) -> str:
    """What healthy looks like, beside the run's figures (docs/en/router_health.md, ranges)."""
    known = run.topk and run.num_experts
    uniform = f"{run.topk / run.num_experts:.3g}" if known else "top_k/E"
    shape = f" for this run's {run.num_experts} experts, top-{run.topk}" if known else ""
    # The level for the run's own E and k: the random-routing level scales with k/E, so a
    # figure measured on another shape (the tiny recipes' 8 experts) would mislead here.
    return (
        f"reference: routing at random gives confidence {uniform} and entropy 1{shape}; a "
        f"router that has not learned to choose stays near {uniform} with many near ties, one "
        f"that has shows confidence well above {uniform} and near ties falling; a |logit| max "
        "that grows by orders of magnitude precedes divergence"
    )


#: How many layers with the most near ties the picture marks (at most a third of them).
MARKED_LAYERS = 3


def read_series(path: Path, lines: list[Line]) -> tuple[list[int], dict[str, dict], dict]:
    """One pass: ``(steps, {stat: {layer: values}}, {summary key: values})``, NaN where absent."""
    steps: list[int] = []
    layers: dict[str, dict[int, list[float]]] = {
        "router_confidence": {},
        "router_near_tie_fraction": {},
    }
    sums: dict[str, list[float]] = {key: [] for key in _SUMMARIES}
    with path.open("rb") as f:
        for line in lines:
            record = read_line(f, line)
            if mn.ROUTER_CONFIDENCE not in record:
                continue
            steps.append(line.step)
            for key, vs in sums.items():
                value = record.get(key)
                vs.append(float(value) if isinstance(value, int | float) else math.nan)
            for key, value in record.items():
                m = _LAYER_KEY.match(key)
                if m and isinstance(value, int | float):
                    by_layer = layers[m.group(2)]
                    by_layer.setdefault(int(m.group(1)), [math.nan] * (len(steps) - 1))
                    by_layer[int(m.group(1))].append(float(value))
            for by_layer in layers.values():
                for vs in by_layer.values():
                    if len(vs) < len(steps):
                        vs.append(math.nan)
    return steps, layers, sums


def render_router_health(
    run: RunInfo,
    path: Path,
    steps: list[int],
    layers: dict[str, dict[int, list[float]]],
    sums: dict[str, list[float]],
    marked: list[int],
) -> None:
    """Three panels over steps: confidence, near-tie share (per layer, or the summaries), and
    the global-batch next to the micro-batch max/ideal."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4.5), dpi=110, layout="constrained")
    conf_ax, tie_ax, bal_ax = fig.subplots(1, 3, sharex=True)
    marker = "o" if len(steps) <= 20 else None
    cmap = layer_colours()
    for ax, stat, label, summary in (
        (conf_ax, "router_confidence", "router confidence (sum of p over the chosen experts)",
         (mn.ROUTER_CONFIDENCE, mn.ROUTER_CONFIDENCE_MIN)),
        (tie_ax, "router_near_tie_fraction", "share of tokens decided by a near tie",
         (mn.ROUTER_NEAR_TIE_FRACTION, mn.ROUTER_NEAR_TIE_FRACTION_MAX)),
    ):  # fmt: skip
        by_layer = layers[stat]
        if by_layer:
            ids = sorted(by_layer)
            span = max(1, len(ids) - 1)
            for i, layer in enumerate(ids):
                hot = layer in marked
                ax.plot(steps, by_layer[layer], marker=marker, ms=3,
                        color="tab:red" if hot else cmap(i / span), lw=2.0 if hot else 1.0,
                        alpha=1.0 if hot or len(ids) <= 10 else 0.35,
                        label=f"layer {layer}" + (" (most near ties)" if hot else "")
                        if hot or len(ids) <= 10 else None)  # fmt: skip
        else:
            mean_key, edge_key = summary
            ax.plot(steps, sums[mean_key], color="black", marker=marker, ms=3, label="mean")
            ax.plot(steps, sums[edge_key], color="tab:red", marker=marker, ms=3,
                    label="worst layer")  # fmt: skip
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    if run.topk and run.num_experts:  # the level reference_line names in the summary
        conf_ax.axhline(run.topk / run.num_experts, color="grey", ls="--", lw=1,
                        label="random routing (top-k / experts = "
                              f"{run.topk / run.num_experts:.3g})")  # fmt: skip
    conf_ax.set_title(f"{run.name}: router confidence per layer", fontsize=10, loc="left")
    tie_ax.set_title("near ties per layer (worst layers in red)", fontsize=10, loc="left")
    bal_ax.plot(steps, sums[mn.MAX_OVER_IDEAL], color="black", marker=marker, ms=3,
                label="global batch (moe/max_over_ideal)")  # fmt: skip
    bal_ax.plot(steps, sums[mn.MAX_OVER_IDEAL_MICROBATCH], color="tab:orange", marker=marker,
                ms=3, label="per microbatch (moe/max_over_ideal_microbatch)")  # fmt: skip
    bal_ax.axhline(1.0, color="grey", ls="--", lw=1, label="ideal")
    bal_ax.set_ylabel("busiest expert's load / ideal (mean over layers)")
    bal_ax.set_title("balance: global batch vs microbatch", fontsize=10, loc="left")
    for ax in (conf_ax, tie_ax, bal_ax):
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.savefig(path)


def router_health_report_lines(
    run: RunInfo, path: Path, lines: list[Line], out_dir: Path, draw: bool = True
) -> list[str]:
    """The summary lines (and the picture) of a run with router health; [] for the others."""
    last = last_values(path, lines, list(_SUMMARIES))
    if mn.ROUTER_CONFIDENCE not in last:
        return []
    parts = [f"confidence {last[mn.ROUTER_CONFIDENCE]:.3f}"]
    if mn.ROUTER_NEAR_TIE_FRACTION in last:
        parts.append(
            f"near ties {last[mn.ROUTER_NEAR_TIE_FRACTION]:.1%} "
            f"(worst layer {last.get(mn.ROUTER_NEAR_TIE_FRACTION_MAX, math.nan):.1%})"
        )
    if mn.ROUTER_LOGIT_MAX_ABS in last:
        parts.append(f"|logit| max {last[mn.ROUTER_LOGIT_MAX_ABS]:.3g}")
    if mn.MAX_OVER_IDEAL_MICROBATCH in last and mn.MAX_OVER_IDEAL in last:
        parts.append(
            f"max/ideal per microbatch {last[mn.MAX_OVER_IDEAL_MICROBATCH]:.2f} vs global batch "
            f"{last[mn.MAX_OVER_IDEAL]:.2f}"
        )
    out = ["router health (last step): " + ", ".join(parts), reference_line(run)]
    steps, layers, sums = read_series(path, lines)
    ties = layers["router_near_tie_fraction"]
    marked: list[int] = []
    if ties:
        means = {la: float(np.nanmean(v)) for la, v in ties.items()}
        count = max(1, min(MARKED_LAYERS, len(means) // 3))
        marked = sorted(means, key=lambda la: -means[la])[:count]
        shown = ", ".join(f"layer {la} {means[la]:.1%}" for la in marked)
        out.append(f"most near ties (mean over {len(steps)} steps): {shown}")
    if draw:
        render_router_health(run, out_dir / ROUTER_HEALTH_FILE, steps, layers, sums, marked)
        out.append(f"wrote {out_dir / ROUTER_HEALTH_FILE}")
    return out
