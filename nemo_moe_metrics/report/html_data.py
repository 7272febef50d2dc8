"""What ``report --html`` embeds: a run's expert counts in step bins, its scalars over steps,
alerts, rollout beside training loads and the placement sweep, as one JSON-ready dict.

Everything is read through the report's own readers (the store in blocks, the JSONL streamed)
and bounded: the counts cube ``[bins, layers, experts]`` keeps at most :data:`MAX_BINS` step
bins, fewer when its compressed bytes would pass :data:`CUBE_BYTES`; bins merge pairwise
(:class:`~nemo_moe_metrics.report.timeline.StepBins`, the rule of the report's over-steps
picture), so each bin sums the tokens of ``width`` consecutive logged steps. Scalars are the
mean of their logged values in bins of the same rule, at most :data:`MAX_POINTS` per series.

Arrays travel as :func:`packed`: little-endian, byte-shuffled, zlib-compressed and base64
encoded; the page inflates them with the browser's own ``DecompressionStream``.
"""

from __future__ import annotations

import base64
import math
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.load_over_steps import real_experts
from nemo_moe_metrics.report.expert_counts import jsonl_table_counts
from nemo_moe_metrics.report.placement import phase_sweeps
from nemo_moe_metrics.report.reading import (
    METRICS_FILE,
    Line,
    ReportError,
    Window,
    alert_records,
    experts_text,
    key_series,
    layer_stat_series,
    run_info,
    scan_jsonl,
)
from nemo_moe_metrics.report.timeline import StepBins, bin_width
from nemo_moe_metrics.sinks.store import StoreError, read_expert_load_blocks, store_path

#: Step bins of the counts cube at most (the report's over-steps picture keeps as many).
MAX_BINS = 512
#: The counts cube's compressed bytes at most (base64 then adds a third).
CUBE_BYTES = 3_500_000
#: Cells ``bins x layers x experts`` accumulated at most, before compression (memory bound).
CUBE_CELLS = 1 << 22
#: Points per scalar series at most.
MAX_POINTS = 512
#: Alerts marked on the time axes at most (the summary counts them all).
MAX_ALERTS = 1000
#: The layers drawn as lines in the per-layer charts: the worst by mean max/ideal.
WORST_LAYERS = 6

# Scalar charts: (id, title, y title, [(key, label)]); a chart is shown when any key is logged.
SCALAR_CHARTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("throughput", "Throughput", "tokens / s", (
        (mn.TOKENS_PER_SECOND, "tokens/s (step)"),
        (mn.CUMULATIVE_TOKENS_PER_SECOND, "tokens/s (cumulative)"),
    )),
    ("flops", "Compute", "TFLOP/s per GPU", ((mn.TFLOPS_PER_GPU, "TFLOP/s per GPU"),)),
    ("mfu", "MFU", "model FLOP utilisation", ((mn.MFU, "MFU"),)),
    ("aux", "Aux losses", "loss (mean over MoE layers)", tuple(
        (mn.aux_loss_key(n), n)
        for n in (*mn.AUX_LOSS_TRACKER_NAMES.values(), mn.Z_LOSS)
    )),
    ("bias", "Aux-loss-free expert bias", "score units", (
        (mn.EXPERT_BIAS_RANGE, "bias range (max - min)"),
        (mn.EXPERT_BIAS_UPDATE, "bias update"),
    )),
    ("balance", "Balance (logged)", "busiest expert / ideal", (
        (mn.MAX_OVER_IDEAL, "max/ideal, mean over layers"),
        (mn.MAX_OVER_IDEAL_MAX, "max/ideal, worst layer"),
        (mn.MAX_OVER_IDEAL_MICROBATCH, "max/ideal per microbatch"),
        (mn.ROLLOUT_MAX_OVER_IDEAL, "max/ideal of the rollout's routes"),
    )),
    ("health", "Router health", "share", (
        (mn.ROUTER_CONFIDENCE, "confidence, mean"),
        (mn.ROUTER_CONFIDENCE_MIN, "confidence, worst layer"),
        (mn.ROUTER_NEAR_TIE_FRACTION, "near ties, mean"),
        (mn.ROUTER_NEAR_TIE_FRACTION_MAX, "near ties, worst layer"),
        (mn.ROUTER_TOPK_RELATIVE_GAP, "top-k relative gap"),
    )),
    ("logits", "Router logits", "|logit|", (
        (mn.ROUTER_LOGIT_MAX_ABS, "|logit| max"),
        (mn.ROUTER_LOGIT_RMS, "logit RMS"),
    )),
    ("routing", "Routing consistency (rollout vs training)", "share of (token, layer) pairs", (
        (mn.ROUTING_DISAGREEMENT, "disagreement"),
        (mn.ROUTING_REPLAY_MISMATCH, "router replay mismatch"),
        (mn.ROUTING_MISSING_FRACTION, "pairs without a rollout route"),
    )),
)  # fmt: skip
# Per-layer series read from the JSONL (worst layers drawn), when the run logs them.
LAYER_CHARTS = (
    ("routing_layers", "Routing disagreement per layer", "routing_disagreement"),
    ("near_ties_layers", "Near ties per layer", "router_near_tie_fraction"),
)
# ... and, for a run without expert counts, its logged per-layer balance.
LOGGED_BALANCE = ("moi_layers", "Max/ideal per layer (logged)", "max_over_ideal")


def packed(values: np.ndarray) -> dict[str, Any]:
    """An integer or float array for the page: ``{dtype, shape, b64}``, little-endian, bytes
    shuffled by significance (high bytes of counts are mostly zero: they compress to nothing),
    zlib-compressed. Integers below 2**32 travel as uint32, others as float64 (exact below
    2**53)."""
    a = np.asarray(values)
    if a.dtype.kind in "iub" and (a.size == 0 or (a.min() >= 0 and a.max() < 2**32)):
        a = a.astype("<u4")
    else:
        a = a.astype("<f8")
    shuffled = np.frombuffer(a.tobytes(), np.uint8).reshape(-1, a.itemsize).T.tobytes()
    return {
        "dtype": "uint32" if a.dtype.kind == "u" else "float64",
        "shape": list(a.shape),
        "b64": base64.b64encode(zlib.compress(shuffled, 6)).decode("ascii"),
    }


def unpacked(data: dict[str, Any]) -> np.ndarray:
    """The array :func:`packed` encoded (what the page decodes; for tests and tools)."""
    dtype = np.dtype("<u4" if data["dtype"] == "uint32" else "<f8")
    raw = zlib.decompress(base64.b64decode(data["b64"]))
    planes = np.frombuffer(raw, np.uint8).reshape(dtype.itemsize, -1)
    return np.frombuffer(planes.T.tobytes(), dtype).reshape(data["shape"])


class CountCube:
    """Expert counts in step bins (tokens summed) and each cell's dead streak at the end of
    every bin: the logged steps up to and including the bin's last in which the expert got no
    token while its layer routed some (the rule of :class:`~nemo_moe_metrics.moe.
    load_over_steps.DeadStreaks`, whose streak records the page does not need)."""

    def __init__(self, layer_ids: list[int], shape: tuple[int, int], widths: np.ndarray | None):
        cells = max(1, shape[0] * shape[1])
        self.layer_ids = layer_ids
        self.widths = widths
        self.real = real_experts(widths, shape[1])  # None: every column is an expert
        self.bins = StepBins(shape, max_bins=max(2, min(MAX_BINS, CUBE_CELLS // cells)))
        self.streak = np.zeros((self.bins.n, *shape), dtype=np.int64)
        self.run = np.zeros(shape, dtype=np.int64)  # each cell's streak so far
        self.steps = 0

    def add_block(
        self, steps: Iterable[int], layer_ids: list[int], counts: np.ndarray, widths: Any
    ) -> None:
        """Logged steps' counts ``[K, L, E]`` in order, after the steps already added."""
        same_widths = (widths is None and self.widths is None) or (
            widths is not None and self.widths is not None and np.array_equal(widths, self.widths)
        )
        if layer_ids != self.layer_ids or counts.shape[1:] != self.run.shape or not same_widths:
            raise ReportError(
                f"step {next(iter(steps))} has MoE layers {layer_ids} x "
                f"{experts_text(_w(widths, counts))} experts but the first step had "
                f"{self.layer_ids} x {experts_text(_w(self.widths, counts))}; the model "
                "changed within the run: report each part on its own with --steps FIRST:LAST"
            )
        dead = (counts == 0) & (counts.sum(axis=2, keepdims=True) > 0)
        if self.real is not None:
            dead &= self.real
        for k, step in enumerate(steps):
            self.run += 1
            self.run *= dead[k]
            width = self.bins.width
            self.bins.add(int(step), counts[k])
            if self.bins.width != width:  # merged pairwise: a bin's streak is its last step's
                used = self.bins.used - 1  # the bins before this step's new one
                self.streak[:used] = self.streak[1 : 2 * used : 2]
            self.streak[self.bins.used - 1] = self.run
            self.steps += 1

    def halve(self) -> None:
        """Merge the bins pairwise once more (the page's byte budget)."""
        used = self.bins.used
        keep = self.streak[1:used:2].copy()
        odd = self.streak[used - 1].copy()
        self.bins.halve()
        self.streak[: len(keep)] = keep
        if used % 2:
            self.streak[len(keep)] = odd

    def page(self) -> dict[str, Any]:
        """The cube for the page, merged pairwise until it fits :data:`CUBE_BYTES`."""
        while True:
            n = self.bins.used
            sample = packed(self.bins.sums[: min(n, 4)])
            estimate = len(sample["b64"]) * 3 / 4 * n / min(n, 4)
            if estimate <= CUBE_BYTES * 1.1 or n == 1:
                counts = packed(self.bins.sums[:n])
                if len(counts["b64"]) * 3 / 4 <= CUBE_BYTES or n == 1:
                    break
            self.halve()
        b = self.bins
        return {
            "counts": counts,
            "streak": packed(self.streak[:n]),
            "first": b.first[:n].tolist(),
            "last": b.last[:n].tolist(),
            "size": b.size[:n].tolist(),
            "width": b.width,
            "logged": self.steps,
        }


def _w(widths: Any, counts: np.ndarray) -> Any:
    return counts.shape[1] if widths is None else widths


def layer_stats(sums: np.ndarray, widths: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per bin and layer ``[bins, L]``: the busiest expert over the ideal, the coefficient of
    variation of the experts' tokens and the experts with 0 tokens (layers that routed some),
    from each bin's summed counts; a layer's own number of experts when they differ."""
    n_exp = sums.shape[2]
    real = real_experts(widths, n_exp)
    width = np.full(sums.shape[1], n_exp) if widths is None else np.asarray(widths)
    c = sums.astype(np.float64)
    total = c.sum(axis=2)
    mean = total / width
    if real is not None:
        c = np.where(real, c, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        moi = np.nanmax(c, axis=2) / mean
        cv = np.sqrt(np.nansum((c - mean[..., None]) ** 2, axis=2) / width) / mean
    dead = np.where(total > 0, np.nansum(c == 0, axis=2), np.nan)
    empty = total == 0
    return {
        "max_over_ideal": np.where(empty, np.nan, moi),
        "cv": np.where(empty, np.nan, cv),
        "dead": dead,
    }


def _round(values: Iterable[float], digits: int = 5) -> list[float | None]:
    out: list[float | None] = []
    for v in values:
        f = float(v)
        out.append(None if not math.isfinite(f) else float(f"{f:.{digits}g}"))
    return out


def binned_means(values: np.ndarray, width: int) -> np.ndarray:
    """The mean of each run of ``width`` consecutive values, NaN ignored (NaN when all are)."""
    n = len(values)
    pad = (-n) % width
    v = np.concatenate([values, np.full(pad, np.nan)]).reshape(-1, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(v, axis=1)


def _read_cube(
    run_dir: Path, steps: Window | None, lines: list[Line], skipped: list[str]
) -> CountCube | None:
    cube: CountCube | None = None

    def add(steps: Any, ids: Any, counts: np.ndarray, widths: Any) -> None:
        nonlocal cube
        ids = [int(i) for i in ids]
        w = None if real_experts(widths, counts.shape[2]) is None else np.asarray(widths)
        if cube is None:
            cube = CountCube(ids, counts.shape[1:], w)
        cube.add_block(steps, ids, counts, w)

    path = store_path(run_dir)
    if path.is_file():
        lo, hi = steps if steps is not None else (None, None)
        # Decoded ahead by two threads (zlib releases the GIL); none of the report's per-step
        # arithmetic (shares, entropies, drift): the page needs the counts alone.
        blocks = read_expert_load_blocks(
            path, slice(lo, None if hi is None else hi + 1), workers=2, widths=True,
            skipped=skipped,
        )  # fmt: skip
        try:
            for block in blocks:
                order = np.argsort(block.layer_ids, kind="stable")  # ascending, as the report
                widths = block.widths[order]
                add(block.steps.tolist(), block.layer_ids[order], block.counts[:, order], widths)
        except StoreError:
            return None  # the summary at the top of the page says why
    else:
        info = run_info(run_dir)
        path = run_dir / METRICS_FILE
        for step, ids, counts, widths in jsonl_table_counts(path, lines, info.num_experts):
            order = np.argsort(ids, kind="stable")
            add([step], np.asarray(ids)[order], counts[order][None], np.asarray(widths)[order])
    return cube


def _scalar_charts(path: Path, lines: list[Line], width: int) -> list[dict[str, Any]]:
    keys = [k for _, _, _, series in SCALAR_CHARTS for k, _ in series]
    values = key_series(path, lines, keys)
    out = []
    for chart_id, title, y_title, series in SCALAR_CHARTS:
        shown = {
            label: _round(binned_means(values[k], width))
            for k, label in series
            if np.isfinite(values[k]).any()
        }
        if shown:
            out.append({"id": chart_id, "title": title, "y": y_title, "series": shown})
    return out


def _layer_charts(
    path: Path, lines: list[Line], width: int, charts: Iterable[tuple[str, str, str]]
) -> list[dict[str, Any]]:
    out = []
    for chart_id, title, stat in charts:
        series = layer_stat_series(path, lines, stat)
        if not series:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            means = {la: float(np.nanmean(v)) for la, v in series.items()}
        worst = sorted(series, key=lambda la: -np.nan_to_num(means[la], nan=-np.inf))
        shown = {
            f"layer {la}": _round(binned_means(series[la], width)) for la in worst[:WORST_LAYERS]
        }
        out.append({"id": chart_id, "title": title, "y": stat, "series": shown})
    return out


def _alerts(path: Path, lines: list[Line]) -> dict[str, Any]:
    marks = [
        [step, str(r.get("kind")), r.get("layer"), r.get("expert"), r["message"]]
        for step, records in alert_records(path, lines)
        for r in records
    ]
    return {"marks": marks[:MAX_ALERTS], "total": len(marks)}


def _placement(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for ps in phase_sweeps(run_dir):
        w = ps.loads
        after = ps.rows[min(1, len(ps.rows) - 1)]
        out.append(
            {
                "phase": ps.phase,
                "ep_size": ps.ep_size,
                "known": ps.known,
                "first": w.first,
                "last": w.last,
                "logged": w.steps,
                "layers": w.layer_ids.tolist(),
                "tokens": packed(w.weight),
                "today": _round(ps.today),
                "sweep": [
                    {
                        "r": row.redundant_experts,
                        "balancedness": _round(row.balancedness),
                        "expert_time": round(row.expert_time_ratio, 6),
                    }
                    for row in ps.rows
                ],
                "plan_r": after.redundant_experts,
            }
        )
    return out


def page_data(
    run_dir: Path,
    *,
    steps: Window | None = None,
    layers: list[int] | None = None,
) -> dict[str, Any]:
    """Everything the page shows of ``run_dir`` (resolved by the caller), restricted to the
    step window ``steps``; ``layers``: the layer picked first (default: the worst)."""
    path = run_dir / METRICS_FILE
    run = run_info(run_dir)
    skipped: list[str] = []
    lines, seen = scan_jsonl(path, steps, skipped)
    if not lines:
        raise ReportError(f"{path} holds no step records in the window (the log has {seen})")
    cube = _read_cube(run_dir, steps, lines, skipped)
    has_counts = cube is not None and cube.steps > 0
    width = bin_width(len(lines), MAX_POINTS)
    step_list = np.array([ln.step for ln in lines], dtype=np.float64)
    data: dict[str, Any] = {
        "run": run.name,
        "topk": run.topk,
        "first_step": lines[0].step,
        "last_step": lines[-1].step,
        "logged": len(lines),
        "scalar_width": width,
        "scalar_steps": _round(binned_means(step_list, width), 12),
        "scalars": _scalar_charts(path, lines, width)
        + _layer_charts(
            path, lines, width, LAYER_CHARTS if has_counts else (*LAYER_CHARTS, LOGGED_BALANCE)
        ),
        "alerts": _alerts(path, lines),
        "placement": _placement(run_dir),
        "rollout_store": store_path(run_dir, "rollout").is_file(),
        "counts": None,
    }
    if cube is not None and has_counts:
        counts = cube.page()
        n = cube.bins.used
        stats = layer_stats(cube.bins.sums[:n], cube.widths)
        n_exp = cube.streak.shape[2]
        widths = cube.widths if cube.widths is not None else np.full(len(cube.layer_ids), n_exp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_moi = np.nanmean(stats["max_over_ideal"], axis=0)
        order = np.argsort(-np.nan_to_num(mean_moi, nan=-np.inf), kind="stable")
        picked = cube.layer_ids[int(order[0])]
        if layers:
            known = [la for la in layers if la in cube.layer_ids]
            if not known:
                raise ReportError(
                    f"--layers {','.join(map(str, layers))}: no MoE layer {layers} in the run; "
                    f"its MoE layers are {cube.layer_ids}"
                )
            picked = known[0]
        data["counts"] = {
            **counts,
            "layers": cube.layer_ids,
            "experts": n_exp,
            "widths": [int(x) for x in widths],
            "worst_first": [cube.layer_ids[int(i)] for i in order],
            "picked": picked,
            "stats": {k: [_round(row) for row in v.T] for k, v in stats.items()},
        }
    return data
