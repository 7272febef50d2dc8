"""The placement part of the report: what EPLB would do with the run's loads, and the rollout
engine's loads beside training's.

- ``placement_sweep.png``: balancedness (mean GPU load / max GPU load) against the number of
  redundant experts R, one line per MoE layer and the mean in black, for an expert-parallel
  size of :data:`REPORT_EP_SIZE` GPUs (``nemo-moe-metrics placement --ep-size G --sweep`` for
  yours); with rollout loads, a second panel plans from what the engine served.
- ``rollout_vs_train_load.png``: per layer x expert, load over ideal of training (left) and of
  the rollout engine (right) on one colour scale, summed over the last stored steps.

Both read the last :data:`REPORT_STEPS` stored steps of each phase.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nemo_moe_metrics.extras import missing_extra_message, missing_modules
from nemo_moe_metrics.placement.loads import WindowLoads, window_loads
from nemo_moe_metrics.placement.plan import SweepRow, sweep
from nemo_moe_metrics.report.pictures import save_figure
from nemo_moe_metrics.sinks.store import scan_store, store_path

__all__ = [
    "REPORT_EP_SIZE",
    "REPORT_STEPS",
    "ROLLOUT_VS_TRAIN_FILE",
    "SWEEP_FILE",
    "draw_sweep",
    "placement_report_lines",
]

SWEEP_FILE = "placement_sweep.png"
ROLLOUT_VS_TRAIN_FILE = "rollout_vs_train_load.png"
REPORT_EP_SIZE = 8
REPORT_STEPS = 200


def _ep_size(experts: int) -> int:
    """The largest divisor of ``experts`` that is at most :data:`REPORT_EP_SIZE`."""
    return max(g for g in range(1, REPORT_EP_SIZE + 1) if experts % g == 0)


def draw_sweep(path: Path, rows: list[SweepRow], layer_ids: np.ndarray, title: str) -> str:
    """Balancedness vs R, a line per layer; returns the summary line (written or skipped)."""
    return _draw_sweeps(path, [(title, rows, layer_ids)])


def _draw_sweeps(path: Path, panels: list[tuple[str, list[SweepRow], np.ndarray]]) -> str:
    missing = missing_modules("report")
    if missing:
        return f"{path.name} skipped: " + missing_extra_message(missing[0], "report", "drawing it")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(panels), 4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, rows, layer_ids) in zip(axes, panels, strict=True):
        rs = [r.redundant_experts for r in rows]
        table = np.stack([r.balancedness for r in rows])  # [R values, layers]
        for j in range(table.shape[1]):
            ax.plot(rs, table[:, j], lw=0.8, alpha=0.5)
        ax.plot(rs, table.mean(axis=1), color="black", lw=2.2, label="mean over layers")
        ax.set_xlabel("redundant experts R")
        ax.set_ylabel("balancedness (mean / max GPU load)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} ({len(layer_ids)} layers)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)
    return f"wrote {path}"


def _last_steps(run_dir: Path, phase: str) -> WindowLoads | None:
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


def placement_report_lines(run_dir: Path, out_dir: Path, draw: bool) -> list[str]:
    """The report's placement section (``[]`` when the run has no stored loads)."""
    phases = [(p, w) for p in ("train", "rollout") if (w := _last_steps(run_dir, p)) is not None]
    if not phases:
        return []
    out: list[str] = []
    panels = []
    for phase, w in phases:
        experts = w.weight.shape[1]
        g = _ep_size(experts)
        rows = sweep(w.weight, ep_size=g)
        b0, b1 = rows[0].balancedness, rows[min(1, len(rows) - 1)]
        out.append(
            f"placement ({phase} loads, steps {w.first}–{w.last}, {g} GPUs): balancedness "
            f"{b0.mean():.3f} today; EPLB with R={b1.redundant_experts}: "
            f"{b1.balancedness.mean():.3f}, expert time {100 * b1.expert_time_ratio:.1f}% of "
            f"today's (nemo-moe-metrics placement {run_dir} --ep-size G --sweep for yours)"
        )
        panels.append((f"{phase} loads, G={g}", rows, w.layer_ids))
    if draw:
        out.append(_draw_sweeps(out_dir / SWEEP_FILE, panels))
    loads = dict(phases)
    if "rollout" in loads and "train" in loads:
        t, r = loads["train"], loads["rollout"]
        common = np.intersect1d(t.layer_ids, r.layer_ids)
        if common.size and t.weight.shape[1] == r.weight.shape[1]:
            pick = lambda w: w.weight[np.searchsorted(w.layer_ids, common)]  # noqa: E731
            tp, rp = pick(t), pick(r)
            hot_t, hot_r = tp.argmax(axis=1), rp.argmax(axis=1)
            same = int((hot_t == hot_r).sum())
            out.append(
                f"rollout vs training load: the hottest expert is the same in {same} of "
                f"{common.size} layers"
            )
            if draw:
                out.append(_draw_side_by_side(out_dir / ROLLOUT_VS_TRAIN_FILE, t, r))
    return out
