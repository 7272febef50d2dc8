"""logger.alerts: one warning line per crossing, moe/alerts per step, through the real sinks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from nemo_moe_metrics.config import ConfigError, LoggerConfig, load_recipe
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import build_sinks

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

REPO = Path(__file__).resolve().parents[2]


def _rows(counts: np.ndarray) -> list[list]:
    return [
        [la, e, int(c), 100.0 * c / max(1, counts[la].sum())]
        for la, layer in enumerate(counts)
        for e, c in enumerate(layer)
    ]


def _log(tmp_path: Path, steps: list[dict], **alerts) -> list[int]:
    cfg = LoggerConfig(
        tensorboard_enabled=False, wandb_enabled=False, alerts={"enabled": True, **alerts}
    )
    sink = build_sinks(cfg, tmp_path, run_name="alerts")
    for step, metrics in enumerate(steps):
        sink.log(metrics, step)
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)[mn.ALERTS] for line in lines]


@pytest.fixture
def warnings_seen(caplog):
    caplog.set_level(logging.WARNING, logger="nemo_moe_metrics.alerts")
    return lambda: [r.getMessage() for r in caplog.records]


def test_overloaded_expert_warns_once_naming_step_layer_and_expert(tmp_path, warnings_seen):
    hot = np.full((2, 8), 100)
    hot[1, 6] = 520  # 520 of 1,220 tokens: 520 * 8 / 1220 = 3.41x ideal
    calm = np.full((2, 8), 100)
    counts = _log(
        tmp_path,
        [{mn.EXPERT_LOADS: _rows(c)} for c in (calm, hot, hot, calm, hot)],
        max_over_ideal=3.0,
        drift=None,
        dead_steps=None,
    )
    # Fires when the layer crosses, not again while it stays over, again after it came back.
    assert counts == [0, 1, 0, 0, 1]
    line = "moe alert step 1: layer 1 expert 6 load 3.41x ideal > logger.alerts.max_over_ideal=3"
    assert warnings_seen().count(line) == 1
    assert len(warnings_seen()) == 2


def test_dead_expert_warns_when_its_streak_reaches_dead_steps(tmp_path, warnings_seen):
    steps = []
    for s in range(6):
        c = np.full((1, 4), 50)
        if s >= 2:
            c[0, 3] = 0
        steps.append({mn.EXPERT_LOADS: _rows(c)})
    counts = _log(tmp_path, steps, dead_steps=3, drift=None, max_over_ideal=None)
    assert counts == [0, 0, 0, 0, 1, 0]  # dead at steps 2, 3, 4: the third is step 4
    assert warnings_seen() == [
        "moe alert step 4: layer 0 expert 3 got no token for 3 logged step(s) (since step 2) "
        ">= logger.alerts.dead_steps=3"
    ]


def test_routing_drift_warns_with_the_divergence_and_the_expert_that_moved(tmp_path, warnings_seen):
    a = np.array([[100, 100, 100, 100]])
    b = np.array([[250, 50, 50, 50]])
    # JS(a, b) by hand: shares 1/4 vs (5/8, 1/8, 1/8, 1/8), midpoint (7/16, 3/16, 3/16, 3/16).
    p, q = [0.25] * 4, [5 / 8, 1 / 8, 1 / 8, 1 / 8]
    m = [(x + y) / 2 for x, y in zip(p, q, strict=True)]
    js = sum(
        0.5 * x * np.log2(x / z) + 0.5 * y * np.log2(y / z) for x, y, z in zip(p, q, m, strict=True)
    )
    counts = _log(
        tmp_path,
        [{mn.EXPERT_LOADS: _rows(c)} for c in (a, a, b)],
        drift=0.05,
        dead_steps=None,
        max_over_ideal=None,
    )
    assert counts == [0, 0, 1]
    assert warnings_seen() == [
        f"moe alert step 2: layer 0 routing drift JS {js:.3f} bits since step 1 > "
        "logger.alerts.drift=0.05 (expert 0 moved most: 25.0% -> 62.5% of tokens)"
    ]


def test_dropped_fraction_names_the_layer_and_its_busiest_expert(tmp_path, warnings_seen):
    c = np.array([[300, 100, 100, 100], [100, 100, 100, 100]])
    step = {
        mn.EXPERT_LOADS: _rows(c),
        mn.layer_stat_key(0, "dropped_fraction"): 0.25,
        mn.layer_stat_key(1, "dropped_fraction"): 0.0,
    }
    counts = _log(tmp_path, [step], dropped_fraction=0.2, max_over_ideal=None, drift=None)
    assert counts == [1]
    assert warnings_seen() == [
        "moe alert step 0: layer 0 dropped 25.0% of its top-k choices > "
        "logger.alerts.dropped_fraction=0.2 (busiest expert 0 at 2.00x ideal, at capacity)"
    ]


def test_without_the_table_summaries_still_alert_and_say_what_is_unknown(tmp_path, warnings_seen):
    counts = _log(
        tmp_path,
        [{mn.MAX_OVER_IDEAL_MAX: 5.0, mn.DROPPED_FRACTION: 0.0}],
        max_over_ideal=4.0,
    )
    assert counts == [1]
    assert warnings_seen() == [
        "moe alerts: no moe/expert_loads table in the logged metrics, so the dead-expert and "
        "drift alerts are off; log it with policy.megatron_cfg.log_expert_table=true",
        "moe alert step 0: worst layer's busiest expert 5.00x ideal > "
        "logger.alerts.max_over_ideal=4 (layer and expert unknown: log "
        "policy.megatron_cfg.log_expert_table=true)",
    ]


def test_many_crossings_in_one_step_are_capped_and_counted(tmp_path, warnings_seen):
    c = np.zeros((5, 4), dtype=int)
    c[:, 0] = 100  # every layer on one expert: 4x ideal in all five layers
    counts = _log(
        tmp_path,
        [{mn.EXPERT_LOADS: _rows(c)}],
        max_over_ideal=3.0,
        dead_steps=None,
        max_lines_per_step=2,
    )
    assert counts == [5]
    assert len(warnings_seen()) == 3
    assert warnings_seen()[-1] == (
        "moe alert step 0: 3 more crossing(s) not shown (moe/alerts=5; "
        "logger.alerts.max_lines_per_step=2)"
    )


def test_alerts_off_by_default_log_no_alert_key(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    sink = build_sinks(cfg, tmp_path, run_name="quiet")
    sink.log({mn.MAX_OVER_IDEAL_MAX: 50.0}, 0)
    sink.close()
    assert mn.ALERTS not in json.loads((tmp_path / "metrics.jsonl").read_text())


def test_a_bad_threshold_is_a_recipe_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"logger\.alerts\.max_over_ideal"):
        load_recipe(
            REPO / "examples/configs/sft_moe_tiny.yaml", ["logger.alerts.max_over_ideal=0.5"]
        )


def test_drift_compares_the_steps_that_logged_a_table(tmp_path, warnings_seen):
    a = np.array([[100, 100, 100, 100]])
    b = np.array([[250, 50, 50, 50]])
    scalars = {mn.MAX_OVER_IDEAL_MAX: 1.0}
    steps = [{mn.EXPERT_LOADS: _rows(a)}, scalars, {mn.EXPERT_LOADS: _rows(b)}, scalars]
    counts = _log(tmp_path, steps, drift=0.05, dead_steps=None, max_over_ideal=None)
    assert counts == [0, 0, 1, 0]
    (line,) = warnings_seen()
    assert line.startswith("moe alert step 2: layer 0 routing drift JS ")
    assert " bits since step 0 > logger.alerts.drift=0.05" in line


def test_router_health_alerts_name_the_layer_then_fall_back_to_the_summary(tmp_path, warnings_seen):
    calm = {
        mn.router_health_layer_key(2, "router_near_tie_fraction"): 0.05,
        mn.router_health_layer_key(2, "router_logit_max_abs"): 3.0,
    }
    hot = {
        mn.router_health_layer_key(2, "router_near_tie_fraction"): 0.35,
        mn.router_health_layer_key(2, "router_logit_max_abs"): 61.0,
    }
    summary_only = {mn.ROUTER_NEAR_TIE_FRACTION_MAX: 0.4, mn.ROUTER_LOGIT_MAX_ABS: 12.0}
    off = dict(max_over_ideal=None, drift=None, dead_steps=None, router_near_tie_fraction=0.2)
    counts = _log(tmp_path, [calm, hot, hot, summary_only], **off)
    # Each fires when it starts to hold; the summary-only step is another (unnamed) layer.
    assert counts == [0, 2, 0, 1]
    seen = warnings_seen()
    assert seen[0].startswith(
        "moe alert step 1: layer 2 decides 35.0% of its tokens by a near tie "
        "> logger.alerts.router_near_tie_fraction=0.2"
    )
    assert seen[1].startswith(
        "moe alert step 1: layer 2 router logit |z| reached 61 "
        "> logger.alerts.router_logit_max_abs=50"
    )
    assert seen[2].startswith(
        "moe alert step 3: the worst MoE layer decides 40.0% of its tokens by a near tie"
    )
    assert len(seen) == 3


def test_every_alert_is_recorded_in_its_steps_jsonl_line_and_the_report_lists_them(tmp_path):
    """The API path: build_sinks -> metrics.jsonl "alerts" -> the report summary."""
    from nemo_moe_metrics.report import render_report

    hot = np.full((2, 8), 100)
    hot[1, 6] = 520  # 3.41x ideal in layer 1
    steps = [{mn.EXPERT_LOADS: _rows(c)} for c in (np.full((2, 8), 100), hot, hot)]
    steps[2] = {**steps[2], "moe/layer_0/routing_disagreement": 0.5}
    _log(tmp_path, steps, max_over_ideal=3.0, drift=None, dead_steps=None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["alerts" in r for r in rows] == [False, True, True]
    (over,) = rows[1]["alerts"]
    assert over["kind"] == "max_over_ideal" and (over["layer"], over["expert"]) == (1, 6)
    assert over["message"].startswith("moe alert step 1: layer 1 expert 6 load 3.41x ideal")
    (routing,) = rows[2]["alerts"]  # layer 1 still over: not again; the routing alert is new
    assert routing["kind"] == "routing_disagreement" and routing["layer"] == 0
    assert rows[2][mn.ALERTS] == 1
    assert list(rows[2])[-1] == "alerts"  # after every metric: readers of the scalars skip it
    summary = render_report(tmp_path).splitlines()
    i = summary.index(
        "alerts (logger.alerts): 2 in 2 steps, 1–2; by kind: max_over_ideal 1, "
        "routing_disagreement 1"
    )
    assert summary[i + 1] == "  " + over["message"]
    assert summary[i + 2] == "  " + routing["message"]


def test_a_new_alert_kind_flows_to_the_jsonl_and_the_report_without_other_changes(tmp_path):
    """What issue 32's router-health kinds rely on: a check returning Alert is enough."""
    from nemo_moe_metrics.report import render_report
    from nemo_moe_metrics.sinks.alerts import Alert, AlertMonitor

    class WithNearTies(AlertMonitor):
        def check(self, metrics, step):
            return [*super().check(metrics, step), Alert("router_near_tie_fraction", step, 2,
                    None, f"moe alert step {step}: layer 2 near ties 40% > 0.3")]  # fmt: skip

    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False), tmp_path, run_name="r"
    )
    sink.monitor = WithNearTies(LoggerConfig().alerts)
    sink.log({mn.ROUTED_TOKENS: 10.0}, 0)
    sink.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["alerts"][0]["kind"] == "router_near_tie_fraction" and row[mn.ALERTS] == 1
    assert "  moe alert step 0: layer 2 near ties 40% > 0.3" in render_report(tmp_path)


def test_the_console_shows_one_line_per_alert_and_holds_back_a_flood():
    from nemo_moe_metrics.sinks.alerts import AlertConsole

    now = [0.0]
    console = AlertConsole(per_step=3, per_window=5, window_s=60, clock=lambda: now[0])

    def row(step, n):
        return {
            "step": step,
            "alerts": [{"kind": "k", "message": f"s{step} a{i}"} for i in range(n)],
        }

    assert console.lines({"step": 0, mn.ALERTS: 0}) == []
    lines = console.lines(row(1, 5))  # 3 per step, then one line for the rest of the step
    assert lines[:3] == ["s1 a0", "s1 a1", "s1 a2"]
    assert lines[3].startswith("moe alert step 1: 2 more alert(s) of this step not shown")
    assert console.lines(row(2, 2)) == ["s2 a0"]  # 5 lines per minute
    assert console.lines(row(3, 1)) == []
    now[0] = 61.0  # the window has passed: first the count of what was held back
    lines = console.lines(row(4, 1))
    assert lines[0].startswith("moe alerts: 2 more alert(s) not shown") and lines[1:] == ["s4 a0"]
    assert console.closing_line("nemo-moe-metrics report D").startswith(
        "moe alerts: 4 alert line(s) not shown here"
    )
