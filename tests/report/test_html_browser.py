"""``report --html`` in a real browser: headless Chromium opens the page from a file URL with
the network off, and a real mouse, real keys and the drawn marks are checked against the
store's counts (tests/support/html_page_check.py). Without Chromium these skip; CI installs it and
sets NEMO_MOE_METRICS_REQUIRE_BROWSER=1, so there they fail instead."""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pytest
from html_page_check import check_counts, check_page, embedded, hover, number
from html_run import ALERT_STEP, DEAD, EXPERTS, LAYERS, STEPS, counts_at, streak_at, write_run

from nemo_moe_metrics.cli import main

# Chromium and the page: the same on every megatron-core line.
pytestmark = pytest.mark.one_line


@pytest.fixture(scope="module")
def run_page(tmp_path_factory):
    """The small run of tests/support/html_run.py, its page written by the command, and what the
    command printed."""
    run_dir = write_run(tmp_path_factory.mktemp("html_run") / "run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", str(run_dir), "--html"]) == 0
    return run_dir, run_dir / "report.html", printed.getvalue()


@pytest.fixture(scope="module")
def page(run_page, page_browser):
    """The page open in one tab for the module's tests (each puts the controls where it
    needs them)."""
    if page_browser is None:
        pytest.skip("no Chromium here (apt-get install chromium); CI installs it")
    tab = page_browser.new_page()
    tab.open(run_page[1])
    tab.wait_for("window.nmm && (window.nmm.done || window.nmm.errors.length)", 60)
    yield tab
    tab.close()


def _set(page, control: str, key: str, code: int, times: int) -> None:
    """Press ``key`` ``times`` times in the focused ``control`` (a user at the keyboard)."""
    page.eval(f"document.getElementById('{control}').focus()")
    for _ in range(times):
        page.press(key, code)


def _reset(page) -> None:
    """Last step, one bin, the first layer: where the page opens (keys, not scripts)."""
    _set(page, "step", "End", 35, 1)
    value = int(page.eval("document.getElementById('window').value"))
    _set(page, "window", "ArrowDown", 40, value - 1)
    _set(page, "layer", "Home", 36, 1)
    page.wait_for(
        f"document.getElementById('step-label').textContent.startsWith('steps {STEPS - 1} ')"
    )


def test_page_opens_offline_draws_every_section_and_saves_a_screenshot(run_page, page, tmp_path):
    assert page.eval("window.nmm.errors") == []
    assert page.console_errors() == []
    # Nothing was fetched: the page's own file is its only request (network off anyway).
    assert page.requests() == [run_page[1].resolve().as_uri()]
    drawn = set(page.eval("Object.keys(nmm.views)"))
    assert {"heatmap", "layer_steps", "moi", "cv", "dead"} <= drawn  # expert counts
    assert {"throughput", "flops", "mfu", "aux", "health", "routing", "routing_layers"} <= drawn
    assert {"train_loads", "rollout_loads", "train_sweep", "train_plan", "rollout_sweep"} <= drawn
    assert page.eval("nmm.firstChartMs") < 10_000
    # The summary on top is the one the command printed, before the page's own last line.
    *summary, last = run_page[2].rstrip("\n").split("\n")
    assert page.eval("document.getElementById('summary').textContent") == "\n".join(summary)
    assert summary[0] == "run html_page_run: steps 0–11 (12 logged)"
    said = (
        rf"wrote {re.escape(str(run_page[1]))} "
        r"\(\d\.\d+ MB: open it in a browser, no network needed\)"
    )
    assert re.fullmatch(said, last), last
    shot = page.screenshot(tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_hovering_a_cell_shows_the_stores_tokens_share_and_dead_streak(run_page, page):
    _reset(page)
    last = STEPS - 1
    counts = counts_at(last)  # what the run wrote ...
    stored = check_counts(embedded(run_page[1]), run_page[0])  # ... and the store holds
    np.testing.assert_array_equal(stored[last][1], counts)
    layer, dead_expert, _ = DEAD
    for la, expert in [(1, 0), (3, 7), (layer, dead_expert), (2, 2)]:
        row = LAYERS.index(la)
        tip = hover(page, "heatmap", {"layer": la, "expert": expert})
        tokens = stored[last][1][row, expert]
        assert number(tip["tokens"]) == tokens
        share = 100 * tokens / stored[last][1][row].sum()
        assert number(tip["load % of the layer"]) == pytest.approx(share, abs=5e-4)
        assert number(tip["load / ideal"]) == pytest.approx(share * EXPERTS / 100, abs=5e-4)
        assert int(tip["dead streak (logged steps)"]) == streak_at(last, la, expert)
        assert tip["steps"] == str(last)
    assert streak_at(last, layer, dead_expert) == STEPS - DEAD[2]  # the streak is there


def test_the_step_slider_and_the_window_move_the_heatmap_to_those_steps(run_page, page):
    _reset(page)
    stored = check_counts(embedded(run_page[1]), run_page[0])
    _set(page, "step", "ArrowLeft", 37, 3)  # step 11 -> 8
    page.wait_for("document.getElementById('step-label').textContent.startsWith('steps 8 ')")
    tip = hover(page, "heatmap", {"layer": 3, "expert": 4})
    assert tip["steps"] == "8"
    assert number(tip["tokens"]) == stored[8][1][LAYERS.index(3), 4]
    _set(page, "window", "ArrowUp", 38, 2)  # three bins summed: steps 6-8
    page.wait_for("document.getElementById('step-label').textContent.startsWith('steps 6–8 ')")
    tip = hover(page, "heatmap", {"layer": 3, "expert": 4})
    assert tip["steps"] == "6–8"
    assert number(tip["tokens"]) == sum(stored[s][1][LAYERS.index(3), 4] for s in (6, 7, 8))
    # The per-layer charts shade the same steps.
    assert page.eval("nmm.views.moi.data('window')[0].x0") == 5.5


def test_the_layer_picker_shows_that_layers_experts_over_steps(run_page, page):
    _reset(page)
    stored = check_counts(embedded(run_page[1]), run_page[0])
    _set(page, "layer", "ArrowDown", 40, 1)  # the second layer of the list
    page.wait_for("nmm.views.layer_steps.data('lcells')[0].layer === 2")
    assert page.eval("nmm.views.heatmap.data('pick')[0].layer") == 2
    for step, expert in [(0, 3), (5, 5), (9, 1)]:
        tip = hover(page, "layer_steps", {"layer": 2, "expert": expert, "steps": str(step)})
        assert number(tip["tokens"]) == stored[step][1][LAYERS.index(2), expert]
    # The picked layer joins the per-layer lines, named so.
    series = page.eval("[...new Set(nmm.views.moi.data('lines').map(d => d.series))]")
    assert "layer 2 (picked)" in series


def test_alerts_are_marked_at_their_step_with_their_message(page):
    alerts = page.eval("nmm.views.throughput.data('alerts')")
    assert [(a["step"], a["kind"]) for a in alerts] == [(ALERT_STEP, "dead")]
    shows = ("alert at step", str(ALERT_STEP))
    tip = hover(page, "throughput", {"step": ALERT_STEP}, shows, marktype="symbol")
    assert tip["alert"] == f"moe alert step {ALERT_STEP}: layer 2 expert 5 dead"


def test_the_main_jobs_page_shows_the_stores_counts(main_job_run, browser, tmp_path):
    # The README's main job (GRPO, 2 ranks, every flag on): page checks in the browser.
    check_page(main_job_run, browser, out_dir=tmp_path)
