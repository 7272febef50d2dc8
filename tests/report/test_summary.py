"""The report: both PNGs written, heatmap colours follow the loads, summary numbers by hand."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report import (
    DRIFT_FILE,
    HEATMAP_FILE,
    MAX_OVER_IDEAL_FILE,
    OVER_STEPS_FILE,
    ReportError,
    render_report,
)
from nemo_moe_metrics.sinks import build_sinks

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

REPO = Path(__file__).resolve().parents[2]
N_EXPERTS = 8


def _record(
    run_dir: Path, counts_by_step: dict[int, np.ndarray], extra: dict[int, dict] | None = None
) -> Path:
    """Log [layers, experts] token counts per step through the real sinks (JSONL + store)."""
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    config = {"policy": {"model": {"num_experts": N_EXPERTS, "moe_router_topk": 2}}}
    sink = build_sinks(cfg, run_dir, run_name="tiny-moe", config=config)
    for step, counts in counts_by_step.items():
        rows = [
            [la, e, int(c), 100.0 * c / counts[la].sum()]
            for la, layer in enumerate(counts)
            for e, c in enumerate(layer)
        ]
        sink.log({mn.EXPERT_LOADS: rows, **(extra or {}).get(step, {})}, step)
    sink.close()
    return run_dir


def _uniform(n_layers: int = 2) -> np.ndarray:
    return np.full((n_layers, N_EXPERTS), 100)


def _moved(layer: int, hot: int, cold: int, amount: int = 50) -> np.ndarray:
    """Move tokens from one expert to another: the layer total and every other cell unchanged."""
    counts = _uniform()
    counts[layer, hot] += amount
    counts[layer, cold] -= amount
    return counts


def _heatmap(run_dir: Path) -> np.ndarray:
    render_report(run_dir)
    return imread(run_dir / HEATMAP_FILE)[..., :3]


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b).max(axis=-1) > 0.05


def _column_groups(mask: np.ndarray) -> list[np.ndarray]:
    cols = np.nonzero(mask.any(axis=0))[0]
    return np.split(cols, np.nonzero(np.diff(cols) > 1)[0] + 1)


def test_report_writes_both_pictures_at_a_readable_size(tmp_path):
    _record(tmp_path, {0: _moved(1, 3, 5), 1: _uniform()})
    render_report(tmp_path)
    for name in (HEATMAP_FILE, MAX_OVER_IDEAL_FILE):
        height, width = imread(tmp_path / name).shape[:2]
        assert width >= 1000 and height >= 350, (name, width, height)
        assert (tmp_path / name).stat().st_size > 20_000, name


def test_heatmap_pixels_change_only_where_the_loads_change(tmp_path):
    base = _heatmap(_record(tmp_path / "a", {0: _uniform()}))
    layer1 = _heatmap(_record(tmp_path / "b", {0: _moved(layer=1, hot=3, cold=5)}))
    layer0 = _heatmap(_record(tmp_path / "c", {0: _moved(layer=0, hot=3, cold=5)}))

    mask1, mask0 = _changed(base, layer1), _changed(base, layer0)
    groups = _column_groups(mask1)
    assert len(groups) == 2, "exactly two cells changed: the hot and the cold expert"
    hot, cold = (layer1[:, g][mask1[:, g]].mean(axis=0) for g in groups)
    assert hot[0] > hot[2] + 0.1, f"overloaded expert 3 should be red, got RGB {hot}"
    assert cold[2] > cold[0] + 0.1, f"underloaded expert 5 should be blue, got RGB {cold}"
    # Same experts, other layer: same columns, and layer 0 is drawn above layer 1.
    assert [list(g) for g in _column_groups(mask0)] == [list(g) for g in groups]
    assert np.nonzero(mask0)[0].mean() < np.nonzero(mask1)[0].mean()


def test_dead_expert_is_black_and_named_in_the_summary(tmp_path):
    base = _heatmap(_record(tmp_path / "a", {0: _uniform()}))
    # Where layer 1 / expert 5 is drawn: the cell that changes when that expert loses tokens.
    moved = _heatmap(_record(tmp_path / "b", {0: _moved(layer=1, hot=3, cold=5)}))
    mask = _changed(base, moved)
    mask[:, _column_groups(mask)[0]] = False  # keep expert 5's cell, drop expert 3's
    counts = _uniform()
    counts[1, 5] = 0
    run_dir = _record(tmp_path / "c", {0: counts})
    summary = render_report(run_dir)
    dead = imread(run_dir / HEATMAP_FILE)[..., :3]
    assert "dead experts (0 tokens, step 0): 1 — layer 1: [5]" in summary
    assert np.median(dead[mask], axis=0).max() < 0.2, "a dead expert's cell is black"


def test_summary_worst_layer_matches_hand_arithmetic(tmp_path):
    _record(tmp_path, {0: _moved(1, 3, 5, amount=50)})
    summary = render_report(tmp_path)
    # layer 1: busiest expert 150 tokens of 800 over 8 experts -> 150 * 8 / 800 = 1.50
    assert "worst: layer 1 1.50, layer 0 1.00" in summary
    assert "max/ideal mean 1.25 over 2 MoE layers" in summary


def test_without_a_window_the_heatmap_shows_the_last_step(tmp_path):
    _record(tmp_path, {0: _moved(1, 3, 5, 80), 1: _moved(0, 2, 6, 20)})
    summary = render_report(tmp_path)
    # step 1 only: layer 0 expert 2 has 120 of 800 tokens -> 120 * 8 / 800 = 1.20
    assert "expert load over step 1: max/ideal mean 1.10 over 2 MoE layers" in summary
    assert "worst: layer 0 1.20, layer 1 1.00" in summary


def test_step_window_sums_tokens_over_the_chosen_steps_only(tmp_path):
    _record(tmp_path, {0: _moved(1, 3, 5, 80), 1: _moved(1, 3, 5, 20), 2: _moved(1, 3, 5, 40)})
    summary = render_report(tmp_path, steps=(1, 2))
    # window tokens for expert 3 of layer 1: 120 + 140 = 260 of 1600 -> 260 * 8 / 1600 = 1.30
    assert "steps 1–2 (2 logged, tokens summed)" in summary
    assert "worst: layer 1 1.30" in summary


def test_step_window_outside_the_log_names_the_logged_range(tmp_path):
    _record(tmp_path, {3: _uniform(), 4: _uniform()})
    with pytest.raises(ReportError, match=r"no logged step in 10:20; the log has steps 3..4"):
        render_report(tmp_path, steps=(10, 20))


def test_max_over_ideal_plot_uses_per_layer_keys_when_no_table_was_logged(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    sink = build_sinks(cfg, tmp_path, run_name="no-table")
    for step in range(4):
        sink.log({mn.layer_stat_key(la, "max_over_ideal"): 1 + la + step for la in (1, 2)}, step)
    sink.close()
    summary = render_report(tmp_path)
    assert (tmp_path / MAX_OVER_IDEAL_FILE).is_file()
    assert not (tmp_path / HEATMAP_FILE).exists()
    assert (
        "no expert-load counts in the run (no expert_loads.bin, no moe/expert_loads rows): "
        "expert_load_heatmap.png, expert_load_over_steps.png and routing_drift.png skipped; "
        "log them with MetricsConfig(track_moe_metrics=True, log_expert_table=True)"
    ) in summary


def test_summary_reports_window_tokens_per_second_and_mfu(tmp_path):
    perf = {
        0: {mn.TOKENS: 1000, mn.SECONDS: 1.0, mn.TOKENS_PER_SECOND: 1000.0, mn.MFU: 0.30},
        1: {mn.TOKENS: 3000, mn.SECONDS: 1.0, mn.TOKENS_PER_SECOND: 3000.0, mn.MFU: 0.42},
    }
    _record(tmp_path, {0: _uniform(), 1: _uniform()}, perf)
    summary = render_report(tmp_path)
    # ratio of sums: 4000 tokens / 2 s = 2000 tokens/s (not the mean of per-step rates)
    assert "last step 3,000 tokens/s; window 2,000 tokens/s (ratio of sums)" in summary
    assert "MFU 42.0%" in summary


def test_report_command_prints_summary_and_exits_2_on_a_missing_run(tmp_path):
    _record(tmp_path, {0: _uniform()})
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "report"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(
        [*cmd, str(tmp_path), "--steps", "0"], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert f"wrote {tmp_path / HEATMAP_FILE}" in ok.stdout
    bad = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "does not exist (no such directory)" in bad.stderr and "Traceback" not in bad.stderr


# --- the report command (issue 16 item 7) and the timeline outputs (issue 15 item 3) ---------


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "report", *args]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}  # no COLUMNS: as when piped
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def _four_steps(run_dir: Path) -> Path:
    return _record(run_dir, {s: _moved(1, 3, 5, 10 * (s + 1)) for s in range(4)})


def test_out_writes_every_picture_there_and_leaves_the_run_directory_alone(tmp_path):
    run_dir = _four_steps(tmp_path / "run")
    before = sorted(p.name for p in run_dir.iterdir())
    proc = _cli(str(run_dir), "--out", str(tmp_path / "pics" / "new"))
    assert proc.returncode == 0, proc.stderr
    for name in (HEATMAP_FILE, OVER_STEPS_FILE, DRIFT_FILE, MAX_OVER_IDEAL_FILE):
        assert f"wrote {tmp_path / 'pics' / 'new' / name}" in proc.stdout
        assert (tmp_path / "pics" / "new" / name).stat().st_size > 10_000, name
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.parametrize(
    "window,span", [("2:", "steps 2–3 (2 logged)"), (":1", "steps 0–1 (2 logged)")]
)
def test_open_step_windows_run_to_the_end_or_from_the_start(tmp_path, window, span):
    run_dir = _four_steps(tmp_path)
    proc = _cli(str(run_dir), "--steps", window, "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"run tiny-moe: {span}"
    assert f"expert load over {span.replace('logged', 'logged, tokens summed')}" in proc.stdout


def test_a_bad_step_window_names_every_accepted_form(tmp_path):
    proc = _cli(str(_four_steps(tmp_path)), "--steps", "a:b")
    assert proc.returncode == 2
    assert (
        "give one step (e.g. 100) or an inclusive window FIRST:LAST, FIRST: (to the end) or "
        in proc.stderr
    )


def test_every_skipped_picture_names_the_flag_that_would_produce_it(tmp_path):
    # Scalars only, no table, no per-layer keys, no throughput: everything is skipped.
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    # A recipe's run (run.json holds the Recipe dump): hints name recipe keys.
    sink = build_sinks(cfg, tmp_path, run_name="bare", config={"algorithm": "sft"})
    for step in range(3):
        sink.log({"train/loss": 1.0 / (step + 1)}, step)
    sink.close()
    proc = _cli(str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        "no expert-load counts in the run (no expert_loads.bin, no moe/expert_loads rows): "
        "expert_load_heatmap.png, expert_load_over_steps.png and routing_drift.png skipped; log "
        "them with policy.megatron_cfg.track_moe_metrics=true and log_expert_table=true"
    ) in lines
    assert (
        "no per-layer expert-load data: max_over_ideal.png skipped; log it with "
        "policy.megatron_cfg.moe_per_layer_logging=true or log_expert_table=true"
    ) in lines
    assert "throughput: not logged; enable policy.megatron_cfg.track_throughput=true" in lines
    skipped = [line for line in lines if "skipped" in line or "not logged" in line]
    assert len(skipped) == 4 and all("policy.megatron_cfg." in line for line in skipped)


def test_one_logged_step_skips_the_timeline_pictures_naming_steps_and_table_every(tmp_path):
    proc = _cli(str(_four_steps(tmp_path)), "--steps", "2", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "only 1 logged step with expert counts: expert_load_over_steps.png and "
        "routing_drift.png skipped; they need 2 or more: widen --steps (or log the table more "
        "often with LoggerConfig(table_every=...))"
    ) in proc.stdout.splitlines()


def test_summary_lines_are_never_wrapped_when_piped(tmp_path):
    run_dir = _record(tmp_path, {0: _moved(1, 3, 5, 50), 1: _moved(1, 3, 5, 50)})
    proc = _cli(str(run_dir), "--out", str(tmp_path / "out"))
    long = [line for line in proc.stdout.splitlines() if len(line) > 80]
    assert long, "the summary has lines longer than 80 columns to test with"
    worst = [line for line in proc.stdout.splitlines() if "; worst: " in line]
    assert len(worst) == 1 and worst[0].endswith("worst: layer 1 1.50, layer 0 1.00")


def test_dead_expert_streaks_are_listed_per_layer_with_their_logged_steps(tmp_path):
    steps = {}
    for s in range(8):
        counts = _uniform()
        if 2 <= s <= 6:
            counts[1, 5] = 0  # 5 logged steps dead
        if s <= 1:
            counts[0, 3] = 0  # 2 logged steps dead: shorter than --dead-steps 3
        if s >= 5:
            counts[0, 7] = 0  # dead from step 5 to the end: 3 logged steps
        steps[s] = counts
    proc = _cli(str(_record(tmp_path, steps)), "--dead-steps", "3", "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "dead-expert streaks (0 tokens for >= 3 consecutive logged steps, --dead-steps 3): "
        "2 in 2 layer(s) — layer 0: expert 7 steps 5–7 (3 logged, to the end); "
        "layer 1: expert 5 steps 2–6 (5 logged)"
    ) in proc.stdout.splitlines()


def test_routing_drift_summary_names_the_largest_change_computed_by_hand(tmp_path):
    a, b = _uniform(), _moved(0, 2, 6, 90)  # step 2: layer 0 moves 90 tokens from 6 to 2
    _record(tmp_path, {0: a, 1: a, 2: b, 3: b})
    # JS(uniform, moved) in bits, from the definition: shares 1/8 vs (190, 10)/800 at 2 and 6.
    p, q = [1 / 8] * 8, [100 / 800] * 8
    q[2], q[6] = 190 / 800, 10 / 800
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    js = sum(
        0.5 * x * np.log2(x / z) + 0.5 * y * np.log2(y / z) for x, y, z in zip(p, q, m, strict=True)
    )
    summary = render_report(tmp_path, out_dir=tmp_path / "out")
    assert f"largest {js:.4f} at layer 0 step 2 (from step 1)" in summary
    assert f"mean {js / 6:.4f};" in summary  # one change among 3 steps x 2 layers


def test_layers_option_picks_the_over_steps_panels_and_rejects_unknown_layers(tmp_path):
    run_dir = _four_steps(tmp_path)
    ok = _cli(str(run_dir), "--layers", "0", "--out", str(tmp_path / "out"))
    assert ok.returncode == 0, ok.stderr
    assert "(layers 0: layers asked for (--layers))" in ok.stdout
    bad = _cli(str(run_dir), "--layers", "0,7")
    assert bad.returncode == 2
    assert "error: --layers 0,7: no MoE layer [7] in the run; its MoE layers are [0, 1]" in (
        bad.stderr
    )


def test_runs_from_before_the_store_are_read_from_jsonl_table_rows(tmp_path):
    counts = {0: _moved(1, 3, 5, 50), 1: _moved(0, 2, 6, 20)}
    store_run = _record(tmp_path / "store", counts)
    old = tmp_path / "old"
    old.mkdir()
    with (old / "metrics.jsonl").open("w") as f:
        for step, c in counts.items():
            rows = [
                [la, e, int(v), 100.0 * v / c[la].sum()]
                for la in range(2)
                for e, v in enumerate(c[la])
            ]
            f.write(json.dumps({"step": step, mn.EXPERT_LOADS: rows}) + "\n")
    with_store = render_report(store_run, out_dir=tmp_path / "a").splitlines()[1:5]
    from_rows = render_report(old, out_dir=tmp_path / "b").splitlines()[1:5]
    assert from_rows == with_store
    assert "worst: layer 0 1.20, layer 1 1.00" in from_rows[0]


def test_over_steps_picture_shows_an_expert_hot_then_dead_in_step_order(tmp_path):
    steps = {}
    for s in range(6):
        counts = _moved(1, hot=5, cold=3, amount=50) if s < 3 else _uniform()
        if s >= 3:
            counts[1, 5] = 0  # expert 5: overloaded for steps 0-2, dead for steps 3-5
        steps[s] = counts
    _record(tmp_path, steps)
    render_report(tmp_path, out_dir=tmp_path / "out", layers=[1])
    image = imread(tmp_path / "out" / OVER_STEPS_FILE)[..., :3]
    red = (image[..., 0] > 0.6) & (image[..., 1] < 0.4) & (image[..., 2] < 0.4)
    black = image.max(axis=-1) < 0.1
    # Solid cells, not text: rows with long red and long black runs.
    band = np.nonzero((red.sum(axis=1) > 30) & (black.sum(axis=1) > 30))[0]
    assert len(band) > 5, "expert 5's row shows both red and black cells"
    red_cols = np.nonzero(red[band].all(axis=0))[0]
    black_cols = np.nonzero(black[band].all(axis=0))[0]
    dead_cols = black_cols[black_cols > red_cols.min()]  # not the axes' left spine
    assert len(dead_cols) > 100 and red_cols.max() < dead_cols.min(), "hot, then dead"
    assert np.ptp(band) < image.shape[0] * 0.15, "one expert's row, not the whole panel"


def test_a_window_between_stored_tables_says_to_widen_the_window(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=4)
    sink = build_sinks(cfg, tmp_path, run_name="sparse")
    for step in range(6):
        rows = [[la, e, 100, 12.5] for la in range(2) for e in range(N_EXPERTS)]
        sink.log({mn.EXPERT_LOADS: rows}, step)
    sink.close()
    proc = _cli(str(tmp_path), "--steps", "1:3", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "no stored expert-load step in steps 1–3 (3 logged) (the store holds a table every "
        "LoggerConfig(table_every=...) steps): expert_load_heatmap.png, "
        "expert_load_over_steps.png, routing_drift.png and max_over_ideal.png skipped; "
        "widen --steps"
    ) in proc.stdout.splitlines()


def test_pictures_label_every_expert_order_worst_first_and_give_their_scales(tmp_path, monkeypatch):
    """The figures the report draws, caught on their way to PNG (report/summary.py)."""
    from nemo_moe_metrics.report import pictures, summary

    figures: dict[str, object] = {}

    def catch(name, make):
        def render(run, path, *args, **kwargs):
            figures[path.name] = make(run, *args, **kwargs)

        monkeypatch.setattr(summary, name, render)

    catch("render_over_steps", pictures.over_steps_figure)
    catch("render_layer_series", pictures.layer_series_figure)
    experts, loads = 16, {0: 1.5, 1: 1.2, 2: 2.0}  # busiest expert's share x ideal, per layer
    steps = {}
    for s in range(4):
        counts = np.full((3, experts), 100)
        for layer, ratio in loads.items():
            counts[layer, s] = round(ratio * 100 * (experts - 1) / (experts - ratio))
        steps[s] = counts
    routing = {
        s: {
            "moe/layer_0/routing_disagreement": 0.3,
            mn.ROUTING_DISAGREEMENT: 0.3,
            mn.ROUTING_REPLAY_MISMATCH: 0.0,
        }
        for s in steps
    }
    _record(tmp_path, steps, routing)
    text = render_report(tmp_path, out_dir=tmp_path / "out")
    over = figures[OVER_STEPS_FILE].axes[:3]
    assert [ax.get_ylabel().split(":")[0] for ax in over] == ["layer 2", "layer 0", "layer 1"]
    assert "(layers 2, 0, 1: the 3 worst layers by mean max/ideal, worst first)" in text
    assert [t.get_text() for t in over[0].get_yticklabels()] == [str(e) for e in range(experts)]
    drift = figures[DRIFT_FILE].axes[0]
    assert "0 = same shares, 1 = disjoint experts" in drift.get_ylabel()
    routed = figures["routing_disagreement.png"].axes[0]
    assert routed.get_ylabel() == "routing disagreement (% of pairs)"
    assert max(max(line.get_ydata()) for line in routed.get_lines()) == pytest.approx(30.0)
    title = " ".join(routed.get_title(loc="left").split())
    assert "(token, MoE layer) pairs with a rollout route" in title
    assert "differed from the rollout's on 0.00% of pairs" in title
