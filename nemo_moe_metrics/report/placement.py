"""The placement part of the report: what EPLB would do with the run's loads, and the rollout
engine's loads beside training's.

- ``placement_sweep.png``: balancedness (mean GPU load / max GPU load) against the number of
  redundant experts R = 0, G, ..., 4G, one line per MoE layer and the mean in black, for the
  run's expert-parallel size (``run.json``; else :data:`REPORT_EP_SIZE` GPUs; run
  ``nemo-moe-metrics placement --ep-size G --sweep`` for yours); with rollout loads, a second
  panel plans from what the engine served.
- ``rollout_vs_train_load.png``: per layer x expert, load over ideal of training (left) and of
  the rollout engine (right) on one colour scale, summed over the last stored steps.

Both read the last :data:`REPORT_STEPS` stored steps of each phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.placement.loads import WindowLoads, window_loads
from nemo_moe_metrics.placement.plan import (
    SweepRow,
    balancedness,
    contiguous_placement,
    gpu_loads,
    sweep,
)
from nemo_moe_metrics.report.pictures import save_figure
from nemo_moe_metrics.report.reading import Line, last_values
from nemo_moe_metrics.run_dir.names import (
    ROLLOUT_VS_TRAIN_FILE,
    SWEEP_FILE,
)  # run_dir.names.PICTURES
from nemo_moe_metrics.run_dir.run_json import read_run_json
from nemo_moe_metrics.runtime.extras import missing_extra_message, missing_modules
from nemo_moe_metrics.sinks.store import scan_store, store_path

__all__ = [
    "REPORT_EP_SIZE",
    "REPORT_STEPS",
    "ROLLOUT_VS_TRAIN_FILE",
    "SWEEP_FILE",
    "PhaseSweep",
    "draw_sweep",
    "last_stored_loads",
    "phase_sweeps",
    "placement_report_lines",
]

REPORT_EP_SIZE = 8
REPORT_STEPS = 200
#: The report's sweep goes to R = this many times G (the command's goes to E).
REPORT_SWEEP_GPUS_WORTH = 4


def _ep_size(experts: int) -> int:
    """The largest divisor of ``experts`` that is at most :data:`REPORT_EP_SIZE`."""
    return max(g for g in range(1, REPORT_EP_SIZE + 1) if experts % g == 0)


#: Up to this many layers, the sweep picture names each layer's line in its legend.
MAX_NAMED_LAYERS = 8

#: One panel: title, sweep rows, layer ids, today's (contiguous) mean balancedness.
Panel = tuple[str, list[SweepRow], np.ndarray, float]


def draw_sweep(
    path: Path, rows: list[SweepRow], layer_ids: np.ndarray, title: str, today: float
) -> str:
    """Balancedness vs R, a line per layer, today's contiguous placement dashed; returns the
    summary line (written, or skipped without matplotlib)."""
    return _draw_sweeps(path, [(title, rows, layer_ids, today)])


def _draw_sweeps(path: Path, panels: list[Panel]) -> str:
    missing = missing_modules("report")
    if missing:
        return f"{path.name} skipped: " + missing_extra_message(missing[0], "report", "drawing it")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6 * len(panels), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, rows, layer_ids, today) in zip(axes, panels, strict=True):
        rs = [r.redundant_experts for r in rows]
        table = np.stack([r.balancedness for r in rows])  # [R values, layers]
        few = table.shape[1] <= MAX_NAMED_LAYERS  # each line named; else one entry for all
        for j in range(table.shape[1]):
            label = f"layer {int(layer_ids[j])}" if few else None
            if not few and j == 0:
                label = f"one line per MoE layer ({table.shape[1]})"
            ax.plot(rs, table[:, j], lw=0.8, alpha=0.5, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # R counts experts: no halves
        ax.plot(rs, table.mean(axis=1), color="black", lw=2.2, label="EPLB, mean over layers")
        ax.axhline(today, color="grey", ls="--", lw=1.2, label="today (contiguous), mean")
        ax.set_xlabel("redundant experts R")
        ax.set_ylabel("balancedness (mean / max GPU load)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} ({len(layer_ids)} layers)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7, ncol=2 if few and table.shape[1] > 4 else 1)
    save_figure(fig, path)
    return f"wrote {path}"


def last_stored_loads(run_dir: Path, phase: str) -> WindowLoads | None:
    """The last stored steps of ``phase``; None without any (an unreadable store is the rest
    of the report's to name)."""
    path = store_path(run_dir, phase)
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            steps = scan_store(f).steps
        if not steps:
            return None
        return window_loads(run_dir, phase, sorted(steps)[-REPORT_STEPS:][0], None)
    except (ValueError, OSError):
        return None


def _draw_side_by_side(path: Path, train: WindowLoads, rollout: WindowLoads) -> str:
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    def ratio(w: WindowLoads) -> np.ndarray:
        tot = w.weight.sum(axis=1, keepdims=True)
        ideal = np.where(tot > 0, tot / w.weight.shape[1], 1)
        return np.log2(np.maximum(w.weight / ideal, 1 / 64))

    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=False)
    norm = TwoSlopeNorm(vmin=-6, vcenter=0, vmax=6)
    for ax, (name, w) in zip(axes, (("training", train), ("rollout engine", rollout)), strict=True):
        im = ax.imshow(ratio(w), aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_yticks(range(len(w.layer_ids)), [str(i) for i in w.layer_ids.tolist()], fontsize=6)
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_title(f"{name}: steps {w.first}–{w.last}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="log2(load / ideal)")
    save_figure(fig, path)
    return f"wrote {path}"


def _run_ep_size(run_dir: Path) -> int | None:
    """The run's expert-parallel size from ``run.json`` (its top-level ``ep_size``, which every
    writer records; a recipe's ``expert_model_parallel_size`` in runs written before it)."""
    meta = read_run_json(run_dir)
    size = meta.get("ep_size")
    if size is None:
        size = meta
        for key in ("config", "policy", "megatron_cfg", "expert_model_parallel_size"):
            size = size.get(key) if isinstance(size, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


def _ep_rank_lines(w: WindowLoads, g: int) -> list[str]:
    """Per layer, the busiest EP rank over the mean rank (today's contiguous placement)."""
    loads = gpu_loads(w.weight, contiguous_placement(*w.weight.shape, g), g)
    ratio = loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1e-300)
    worst = np.argsort(-ratio, kind="stable")[:5]
    listed = ", ".join(f"layer {int(w.layer_ids[i])} {ratio[i]:.2f}" for i in worst)
    return [f"EP ranks (G={g}): busiest rank's tokens / mean rank's per layer, worst: {listed}"]


def _slowdown_lines(path: Path, lines: list[Line]) -> list[str]:
    values = last_values(path, lines, [mn.EXPERT_IMBALANCE_SLOWDOWN, mn.MFU])
    slowdown = values.get(mn.EXPERT_IMBALANCE_SLOWDOWN)
    if slowdown is None:
        return []
    text = (
        f"expert imbalance (last step, {mn.EXPERT_IMBALANCE_SLOWDOWN}): the step took an "
        f"estimated {slowdown:.3f}x its time with balanced experts"
    )
    mfu = values.get(mn.MFU)
    if mfu is not None:
        text += f"; MFU {100 * mfu:.1f}% would be {100 * mfu * slowdown:.1f}% with balance"
    return [text]


@dataclass(frozen=True)
class PhaseSweep:
    """EPLB's sweep over one phase's last stored loads, for ``ep_size`` GPUs (the run's own
    expert-parallel size when ``known``, else an assumed one)."""

    phase: str
    loads: WindowLoads
    ep_size: int
    known: bool
    rows: list[SweepRow]
    today: np.ndarray  # [L] balancedness of today's contiguous placement


def phase_sweeps(run_dir: Path) -> list[PhaseSweep]:
    """The sweeps the report draws: training's loads, then the rollout engine's, each over
    its last :data:`REPORT_STEPS` stored steps (the phases without stored loads left out)."""
    run_g = _run_ep_size(run_dir)
    out = []
    for phase in ("train", "rollout"):
        w = last_stored_loads(run_dir, phase)
        if w is None:
            continue
        experts = w.weight.shape[1]
        known = bool(run_g and run_g > 1 and experts % run_g == 0)
        g = run_g if known else _ep_size(experts)
        rows = sweep(w.weight, ep_size=g, most=min(experts, REPORT_SWEEP_GPUS_WORTH * g))
        today = balancedness(gpu_loads(w.weight, contiguous_placement(*w.weight.shape, g), g))
        out.append(PhaseSweep(phase, w, g, known, rows, today))
    return out


def placement_report_lines(
    run_dir: Path, out_dir: Path, draw: bool, path: Path, lines: list[Line]
) -> list[str]:
    """The report's placement section (``[]`` when the run has no stored loads): the cost of
    imbalance, the busiest EP ranks per layer, EPLB's sweep, rollout beside training."""
    out = _slowdown_lines(path, lines)
    sweeps = phase_sweeps(run_dir)
    panels = []
    for ps in sweeps:
        phase, w, g, known, rows = ps.phase, ps.loads, ps.ep_size, ps.known, ps.rows
        if phase == "train" and known:  # the run's own EP ranks (an assumed G says nothing)
            out += _ep_rank_lines(w, g)
        b1 = rows[min(1, len(rows) - 1)]
        today = float(ps.today.mean())
        out.append(
            f"placement ({phase} loads, steps {w.first}–{w.last}, {g} GPUs"
            f"{'' if known else ', assumed: run.json names no expert_model_parallel_size'}): "
            "balancedness "
            f"{today:.3f} today; EPLB with R={b1.redundant_experts}: "
            f"{b1.balancedness.mean():.3f}, expert time {100 * b1.expert_time_ratio:.1f}% of "
            f"today's (nemo-moe-metrics placement {run_dir} --ep-size G --sweep for yours)"
        )
        panels.append((f"{phase} loads, G={g}", rows, w.layer_ids, today))
    if draw and panels:
        out.append(_draw_sweeps(out_dir / SWEEP_FILE, panels))
    loads = {ps.phase: ps.loads for ps in sweeps}
    if "rollout" in loads and "train" in loads:
        t, r = loads["train"], loads["rollout"]
        common = np.intersect1d(t.layer_ids, r.layer_ids)
        if common.size and t.weight.shape[1] == r.weight.shape[1]:
            hot_t = t.weight[np.searchsorted(t.layer_ids, common)].argmax(axis=1)
            hot_r = r.weight[np.searchsorted(r.layer_ids, common)].argmax(axis=1)
            out.append(
                f"rollout vs training load: the hottest expert is the same in "
                f"{int((hot_t == hot_r).sum())} of {common.size} layers"
            )
            if draw:
                out.append(_draw_side_by_side(out_dir / ROLLOUT_VS_TRAIN_FILE, t, r))
    return out
