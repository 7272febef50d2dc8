"""The report: both PNGs written, heatmap colours follow the loads, summary numbers by hand."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from nemo_moe_metrics import metric_names as mn
from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.report import HEATMAP_FILE, MAX_OVER_IDEAL_FILE, ReportError, render_report
from nemo_moe_metrics.sinks import build_sinks

REPO = Path(__file__).resolve().parent.parent
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
        "log them with policy.megatron_cfg.track_moe_metrics=true and log_expert_table=true"
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
    assert "metrics.jsonl not found" in bad.stderr and "Traceback" not in bad.stderr
