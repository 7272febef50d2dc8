"""The report: the text summary of a run, and which pictures it draws from what."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.load_over_steps import Streak, real_experts
from nemo_moe_metrics.report.bias import bias_report_lines
from nemo_moe_metrics.report.expert_counts import jsonl_table_counts, store_blocks, store_has_steps
from nemo_moe_metrics.report.pictures import (
    DRIFT_FILE,
    HEATMAP_FILE,
    MAX_OVER_IDEAL_FILE,
    OVER_STEPS_FILE,
    ROUTING_DISAGREEMENT_FILE,
    bin_ratios,
    colour_limit,
    log_ratio,
    render_heatmap,
    render_layer_series,
    render_over_steps,
    steps_label,
)
from nemo_moe_metrics.report.placement import placement_report_lines
from nemo_moe_metrics.report.reading import (
    METRICS_FILE,
    Line,
    ReportError,
    RunInfo,
    Window,
    alert_records,
    experts_text,
    last_values,
    layer_key_series,
    no_counts_text,
    run_info,
    scan_jsonl,
    window_text,
)
from nemo_moe_metrics.report.router_health_section import router_health_report_lines
from nemo_moe_metrics.report.timeline import Timeline
from nemo_moe_metrics.run_dir.names import PICTURES
from nemo_moe_metrics.run_dir.outputs import OutputError, check_picture_dir
from nemo_moe_metrics.runtime.extras import missing_extra_message, missing_modules
from nemo_moe_metrics.sinks.alerts import summarize_alerts
from nemo_moe_metrics.sinks.store import (
    FILE_HEADER_SIZE,
    STORE_FILE,
    StoreError,
    steps_text,
    store_path,
)

DEFAULT_DEAD_STEPS = 10
DEFAULT_WORST_LAYERS = 4


def _max_over_ideal(counts: np.ndarray, n_experts: int) -> float:
    """The busiest expert's load over the ideal of one layer's counts (``n_experts``: its own
    number of experts; columns beyond are padding zeros, which never hold the maximum)."""
    total = counts.sum()
    return float(counts.max() * n_experts / total) if total > 0 else 0.0


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


def _drift_lines(timeline: Timeline) -> list[str]:
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
    timeline: Timeline, layers: list[int] | None, count: int
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
    badness = np.where(np.isfinite(means), means, -np.inf)
    order = np.argsort(-badness, kind="stable")[:count]  # worst first; ties by layer
    return [int(r) for r in order], f"the {len(order)} worst layers by mean max/ideal, worst first"


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
    run_dir = resolve_run_dir(Path(run_dir))
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    path = run_dir / METRICS_FILE
    missing = missing_modules("report")
    draw = not missing  # without matplotlib: the text summary alone, and a line naming the extra
    if steps is not None and None not in steps and steps[0] > steps[1]:
        raise ReportError(
            f"step window {window_text(steps)} is empty; give FIRST:LAST with FIRST <= LAST"
        )
    if dead_steps < 1:
        raise ReportError(f"--dead-steps {dead_steps}: a streak is at least 1 logged step")
    run = run_info(run_dir)
    skipped: list[str] = []
    lines_, seen = scan_jsonl(path, steps, skipped)
    if seen is None:
        raise ReportError(f"{path} holds no step records yet")
    if not lines_:
        assert steps is not None
        raise ReportError(
            f"no logged step in {window_text(steps)}; the log has steps {seen[0]}..{seen[1]}"
        )
    if draw:
        _make_out_dir(out_dir, run_dir)
    first, last = lines_[0].step, lines_[-1].step
    span = f"step {first}" if first == last else f"steps {first}–{last} ({len(lines_)} logged)"
    out = [f"run {run.name}: {span}"]
    if not draw:
        out.append(
            "pictures skipped: "
            + missing_extra_message(missing[0], "report", "drawing the report's pictures")
        )

    timeline = Timeline(keep_sum=steps is not None, dead_steps=dead_steps)
    unreadable = _read_counts(run_dir, steps, timeline, skipped)
    if unreadable is None and not store_path(run_dir).is_file():
        for step, layer_ids, counts, widths in jsonl_table_counts(path, lines_, run.num_experts):
            timeline.add(step, layer_ids, counts, widths)
    skipped += _missing_from_store(run, lines_, timeline)
    out += [f"skipped: {text}" for text in skipped]

    routed = last_values(path, lines_, [mn.ROUTED_TOKENS]).get(mn.ROUTED_TOKENS)
    if timeline.steps:
        out += _count_pictures(run, timeline, out_dir, layers, draw, windowed=steps is not None)
        if timeline.steps[-1] < last:
            out.append(
                f"the expert counts end at step {timeline.steps[-1]}, the last step with a stored "
                f"table (tables are stored on steps that are multiples of "
                f"{run.hint('table_every')}, default 20); the run logged steps to {last}"
            )
        if routed == 0:
            out.append(
                f"last step: no expert received a training token ({mn.ROUTED_TOKENS} 0), so it "
                "has no balance numbers"
            )
    elif routed == 0:
        out.append(
            f"no expert received a training token ({mn.ROUTED_TOKENS} 0 in the last step; no "
            "training forward inside the step): no expert-load balance to report, "
            f"{HEATMAP_FILE}, {OVER_STEPS_FILE} and {DRIFT_FILE} skipped"
        )
    elif steps is not None and unreadable is None and store_has_steps(run_dir):
        out.append(
            f"no stored expert-load step in {span} (the store holds a table every "
            f"{run.hint('table_every')} steps): {HEATMAP_FILE}, {OVER_STEPS_FILE}, {DRIFT_FILE} "
            f"and {MAX_OVER_IDEAL_FILE} skipped; widen --steps"
        )
    else:
        skipped_pictures = f"{HEATMAP_FILE}, {OVER_STEPS_FILE} and {DRIFT_FILE} skipped"
        stored = store_path(run_dir).is_file()
        out.append(unreadable or no_counts_text(run, stored, span, skipped_pictures))
        dead_last = last_values(path, lines_, [mn.DEAD_EXPERTS]).get(mn.DEAD_EXPERTS)
        if dead_last is not None:
            out.append(f"dead experts (last step, {mn.DEAD_EXPERTS}): {dead_last:g}")
        key_steps, key_series = layer_key_series(path, lines_)
        if key_series:
            _draw(
                draw,
                render_layer_series,
                run,
                out_dir / MAX_OVER_IDEAL_FILE,
                key_steps,
                {la: np.asarray(v) for la, v in key_series.items()},
                ylabel="busiest expert's load / ideal  (1 = balanced)",
                title="worst-expert load per layer",
                ideal=1.0,
            )
            out += _wrote(draw, out_dir / MAX_OVER_IDEAL_FILE)
        else:
            out.append(
                f"no per-layer expert-load data: {MAX_OVER_IDEAL_FILE} skipped; log it with "
                + run.hint("per_layer")
            )

    out += _routing_lines(run, path, lines_, out_dir)
    out += summarize_alerts(alert_records(path, lines_))
    last_keys = [mn.TOKENS_PER_SECOND, mn.TFLOPS_PER_GPU, mn.MFU]
    aux_keys = [mn.aux_loss_key(n) for n in (*mn.AUX_LOSS_TRACKER_NAMES.values(), mn.Z_LOSS)]
    values = last_values(path, lines_, last_keys + aux_keys)
    out += _throughput_lines(lines_, values, run)
    aux = [f"{k} {values[k]:.4g}" for k in aux_keys if k in values]
    bias = bias_report_lines(run, path, lines_, out_dir)  # [] without an expert bias
    out += bias
    out += router_health_report_lines(run, path, lines_, out_dir, draw)  # [] without the flag
    out += placement_report_lines(run_dir, out_dir, draw, path, lines_)  # [] without loads
    if aux:
        out.append("aux losses (last step): " + ", ".join(aux))
    elif routed == 0:
        out.append("aux losses: none (no expert received a training token)")
    elif bias:
        out.append("aux losses: none logged (the routers balance with the expert bias above)")
    elif routed is not None:  # track_moe_metrics was on and counted tokens: no loss to log
        out.append(
            "aux losses: none: the model computes no router aux loss (track_moe_metrics is on; "
            "docs/en/models.md lists the families that have one)"
        )
    else:
        out.append("aux losses: not logged; enable " + run.hint("moe"))
    return "\n".join(out)


def _read_counts(
    run_dir: Path, steps: Window | None, timeline: Timeline, skipped: list[str]
) -> str | None:
    """Fill ``timeline`` from the store; a line saying why it holds nothing when it exists but
    cannot be read (not a store; cut short before its first record), else None."""
    path = store_path(run_dir)
    blocks = store_blocks(run_dir, steps, skipped)
    if blocks is None:
        return None
    try:
        for block in blocks:
            timeline.add_block(block)
    except StoreError as err:
        return (
            f"{err}: expert-load pictures ({HEATMAP_FILE}, {OVER_STEPS_FILE}, {DRIFT_FILE}) "
            "skipped; the scalars below come from metrics.jsonl. Move the file aside if it is "
            "not this run's store"
        )
    size = path.stat().st_size
    if (
        timeline.steps
        or size == FILE_HEADER_SIZE
        or (steps is not None and store_has_steps(run_dir))
    ):
        return None  # counts, or a store that no table step was written to yet (tables off)
    return (
        f"{path} holds no readable record ({size} bytes: cut short or damaged before its first "
        f"complete step; see the skipped lines): {HEATMAP_FILE}, {OVER_STEPS_FILE} and "
        f"{DRIFT_FILE} skipped"
    )


def _missing_from_store(run: RunInfo, lines: list[Line], timeline: Timeline) -> list[str]:
    """Logged steps on the table cadence, from the store's first step on, that it lacks."""
    if not timeline.steps or run.table_every is None:
        return []
    stored = set(timeline.steps)
    first = timeline.steps[0]
    missing = [
        ln.step
        for ln in lines
        if ln.step >= first and ln.step % run.table_every == 0 and ln.step not in stored
    ]
    if not missing:
        return []
    return [
        f"{STORE_FILE}: no counts for logged step(s) {steps_text(missing)} (on the table "
        f"cadence, table_every {run.table_every}): their records are missing or damaged"
    ]


def resolve_run_dir(given: Path) -> Path:
    """The run directory a user meant: ``metrics.jsonl`` (or another file of the run) names its
    directory; a missing path or a folder of runs raises :class:`ReportError` saying so."""
    if given.is_file():
        if given.parent.joinpath(METRICS_FILE).is_file():
            return given.parent
        raise ReportError(
            f"{given} is a file, and no {METRICS_FILE} lies beside it; give the run directory "
            f"(the one holding {METRICS_FILE})"
        )
    if not given.exists():
        parent = next((p for p in given.parents if p.is_dir()), None)
        near = _runs_below(parent, limit=6) if parent is not None else []
        hint = f"; runs in {parent}: {', '.join(str(r) for r in near)}" if near else ""
        raise ReportError(f"{given} does not exist (no such directory){hint}")
    if not (given / METRICS_FILE).is_file():
        runs = _runs_below(given, limit=20)
        if runs:
            listed = "\n".join(f"  {r}" for r in runs)
            return_hint = f"nemo-moe-metrics report {runs[0]}"
            raise ReportError(
                f"{given} is not a run directory (no {METRICS_FILE}); it holds "
                f"{len(runs)} run(s), report one of them (e.g. {return_hint}):\n{listed}"
            )
        raise ReportError(
            f"{given} holds no {METRICS_FILE} and no run below it; "
            "point the report at a run directory written with logger.jsonl_enabled=true "
            "(e.g. runs/grpo_moe_tiny)"
        )
    return given


def _runs_below(folder: Path, limit: int) -> list[Path]:
    # Up to two levels down (runs/<name>/, or an output folder of output folders).
    found = sorted(
        {
            p.parent
            for pattern in ("*/" + METRICS_FILE, "*/*/" + METRICS_FILE)
            for p in folder.glob(pattern)
        }
    )
    return found[:limit]


def _make_out_dir(out_dir: Path, run_dir: Path) -> None:
    """The run directory, or an ``--out DIR`` checked by the output rule (no picture replaces
    a file of a directory that is not a run's or an earlier report's, nor a link)."""
    try:
        if out_dir.resolve() == run_dir.resolve():
            check_picture_dir(out_dir, [])
        else:
            check_picture_dir(out_dir, PICTURES)
    except OutputError as err:
        raise ReportError(str(err)) from None


def _draw(draw: bool, render: Any, *args: Any, **kwargs: Any) -> None:
    if draw:
        render(*args, **kwargs)


def _wrote(draw: bool, path: Path, detail: str = "") -> list[str]:
    return [f"wrote {path}{detail}"] if draw else []


def _count_pictures(
    run: RunInfo,
    timeline: Timeline,
    out_dir: Path,
    layers: list[int] | None,
    draw: bool = True,
    *,
    windowed: bool = False,
) -> list[str]:
    out: list[str] = []
    layer_ids, counts, widths = timeline.layer_ids, timeline.heat, timeline.widths
    assert counts is not None
    heat_steps = timeline.steps if timeline.keep_sum else timeline.steps[-1:]
    layer_widths = timeline.layer_widths()
    per_layer = [_max_over_ideal(c, int(w)) for c, w in zip(counts, layer_widths, strict=True)]
    order = np.argsort(per_layer)[::-1][:3]
    worst = ", ".join(f"layer {layer_ids[i]} {per_layer[i]:.2f}" for i in order)
    # Layers that differ say so (each layer's max/ideal is over its own experts).
    shape = "" if widths is None else f" × {experts_text(layer_widths)} experts"
    out.append(
        f"expert load over {steps_label(heat_steps)}: max/ideal mean "
        f"{np.mean(per_layer):.2f} over {len(layer_ids)} MoE layers{shape}; worst: {worst}"
    )
    span = (
        f"step {heat_steps[0]}"
        if len(heat_steps) == 1
        else f"steps {heat_steps[0]}–{heat_steps[-1]}"
    )
    empty = counts == 0
    real = real_experts(widths, counts.shape[1])
    if real is not None:  # columns beyond a layer's experts are no expert, never dead
        empty &= real
    dead = [(layer_ids[r], int(e)) for r, e in zip(*np.nonzero(empty), strict=True)]
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
    _, heat_shown = log_ratio(counts, widths)
    rows, why = _choose_layers(timeline, layers, DEFAULT_WORST_LAYERS)
    assert timeline.bins is not None
    _, over_shown = (
        bin_ratios(timeline.bins, rows, widths) if several else (None, np.ma.masked_all(0))
    )
    limit = colour_limit(heat_shown, over_shown)
    _draw(
        draw,
        render_heatmap,
        run,
        out_dir / HEATMAP_FILE,
        layer_ids,
        counts,
        heat_steps,
        limit,
        widths,
    )
    out += _wrote(draw, out_dir / HEATMAP_FILE)
    if several:
        _draw(
            draw,
            render_over_steps,
            run,
            out_dir / OVER_STEPS_FILE,
            timeline,
            rows,
            over_shown,
            limit,
            why,
        )
        shown_layers = ", ".join(str(timeline.layer_ids[r]) for r in rows)
        out += _wrote(draw, out_dir / OVER_STEPS_FILE, f" (layers {shown_layers}: {why})")
        drift = np.asarray(timeline.drift)
        _draw(
            draw,
            render_layer_series,
            run,
            out_dir / DRIFT_FILE,
            timeline.steps[1:],
            {la: drift[:, i] for i, la in enumerate(layer_ids)},
            ylabel="JS divergence from the previous logged step\n(bits: 0 = same shares, 1 = "
            "disjoint experts)",
            title="routing drift per layer: Jensen-Shannon divergence of the experts' token "
            "shares, 0 to 1 bit",
            ideal=None,
        )
        out += _wrote(draw, out_dir / DRIFT_FILE)
    elif windowed:
        out.append(
            f"only 1 logged step with expert counts: {OVER_STEPS_FILE} and {DRIFT_FILE} skipped; "
            "they need 2 or more: widen --steps (or log the table more often with "
            f"{run.hint('table_every')})"
        )
    else:
        out.append(
            f"only 1 logged step with expert counts in the whole run: {OVER_STEPS_FILE} and "
            f"{DRIFT_FILE} skipped; they need 2 or more: log the table more often with "
            f"{run.hint('table_every')}, or train more steps"
        )
    moi = np.asarray(timeline.moi)
    _draw(
        draw,
        render_layer_series,
        run,
        out_dir / MAX_OVER_IDEAL_FILE,
        timeline.steps,
        {la: moi[:, i] for i, la in enumerate(layer_ids)},
        ylabel="busiest expert's load / ideal  (1 = balanced)",
        title=f"worst-expert load per layer ({experts_text(timeline.layer_widths())} experts)",
        ideal=1.0,
    )
    out += _wrote(draw, out_dir / MAX_OVER_IDEAL_FILE)
    return out


_LAYER_ROUTING = re.compile(r"^moe/layer_(\d+)/routing_disagreement$")


def _routing_lines(run: RunInfo, path: Path, lines: list[Line], out_dir: Path) -> list[str]:
    """Routing consistency (rollout vs training routes): the worst layers and a picture."""
    keys = [mn.ROUTING_DISAGREEMENT, mn.ROUTING_REPLAY_MISMATCH, mn.ROUTING_MISSING_FRACTION]
    values = last_values(path, lines, keys)
    replay = values.get(mn.ROUTING_REPLAY_MISMATCH)
    if mn.ROUTING_DISAGREEMENT not in values:
        return []
    head = f"routing disagreement (last step, {mn.ROUTING_DISAGREEMENT}): "
    head += f"{values[mn.ROUTING_DISAGREEMENT]:.2%}"
    if mn.ROUTING_REPLAY_MISMATCH in values:
        head += f"; router replay mismatch {values[mn.ROUTING_REPLAY_MISMATCH]:.2%}"
    if mn.ROUTING_MISSING_FRACTION in values:
        head += f"; pairs without a rollout route {values[mn.ROUTING_MISSING_FRACTION]:.2%}"
    out = [head]
    steps, series = layer_key_series(path, lines, _LAYER_ROUTING)
    if not series:
        out.append(
            f"no per-layer routing data: {ROUTING_DISAGREEMENT_FILE} skipped; log it with "
            "policy.megatron_cfg.moe_per_layer_logging=true"
        )
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = {la: float(np.nanmean(v)) for la, v in series.items()}
    worst = sorted(means, key=lambda la: -means[la] if np.isfinite(means[la]) else 1.0)
    shown = ", ".join(f"layer {la} {means[la]:.2%}" for la in worst[:DEFAULT_WORST_LAYERS])
    out.append(f"routing disagreement, worst layers (mean over {len(steps)} steps): {shown}")
    title = (
        "routing disagreement per layer (0% = identical): % of (token, MoE layer) pairs\n"
        "with a rollout route whose top-k set the training router chose differently"
    )
    if replay is not None:
        title += (
            f"\nrouter replay on: the experts executed differed from the rollout's on "
            f"{replay:.2%} of pairs (moe/routing_replay_mismatch, last step);\nthe router's own "
            "choice, drawn here, may still differ"
        )
    render_layer_series(
        run,
        out_dir / ROUTING_DISAGREEMENT_FILE,
        steps,
        {la: 100.0 * np.asarray(v) for la, v in series.items()},
        ylabel="routing disagreement (% of pairs)",
        title=title,
        ideal=None,
    )
    out.append(f"wrote {out_dir / ROUTING_DISAGREEMENT_FILE}")
    return out


def _throughput_lines(lines: list[Line], values: dict[str, float], run: RunInfo) -> list[str]:
    tps = values.get(mn.TOKENS_PER_SECOND)
    if tps is None:
        return ["throughput: not logged; enable " + run.hint("throughput")]
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
        perf.append(f"MFU not logged (unknown accelerator peak; {run.hint('peak')})")
    if perf:
        out.append("compute (last step): " + ", ".join(perf))
    else:
        out.append("compute: not logged; enable " + run.hint("flops"))
    return out
