"""A real ``run`` piped like a user's log: progress bar time, unwrapped summary, alerts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_moe_metrics.export import metric_names as names

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("piped")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(HOME=str(tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_moe_metrics.cli",
            "run",
            str(GRPO),
            "training.max_steps=2",
            "logger.table_every=1",
            "logger.wandb_enabled=false",
            "logger.alerts.enabled=true",
            "logger.alerts.max_over_ideal=1.01",  # a tiny model is never that balanced
            "--nproc",
            "2",
            "--output-dir",
            str(tmp / "runs"),
        ],
        capture_output=True,  # a pipe: rich sees no terminal and 80 columns
        text=True,
        env=env,
        timeout=280,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, tmp / "runs" / "grpo_moe_tiny"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_piped_progress_bar_shows_steps_and_elapsed_time(piped_run):
    proc, _ = piped_run
    bar = [line for line in proc.stdout.splitlines() if line.startswith("grpo_moe_tiny")]
    assert bar and re.search(r" 2/2 \d+:\d\d:\d\d ", bar[-1]), bar


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_piped_summary_lines_are_whole(piped_run):
    proc, _ = piped_run
    pattern = re.compile(
        r"^expert load over step 1: max/ideal mean \d+\.\d\d over 3 MoE layers; "
        r"worst: layer \d \d+\.\d\d, layer \d \d+\.\d\d, layer \d \d+\.\d\d$"
    )
    assert any(pattern.match(line) for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_alerts_in_a_real_grpo_run_print_a_line_and_count_per_step(piped_run):
    _, run_dir = piped_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # Step 0: every MoE layer crosses 1.01; step 1: they stay over, so nothing new fires.
    assert rows[0][names.ALERTS] == 3 and rows[1][names.ALERTS] == 0
    logs = "".join(
        p.read_text(errors="replace") for p in (run_dir / "nemo_run").rglob("*") if p.is_file()
    )
    line = (
        r"moe alert step 0: layer [123] expert \d load \d+\.\d\dx ideal > "
        r"logger\.alerts\.max_over_ideal=1\.01"
    )
    assert re.search(line, logs)
    # Recorded with the step in metrics.jsonl, one line each on run's console, and listed by
    # the report summary that run prints at the end.
    assert [a["kind"] for a in rows[0]["alerts"]] == ["max_over_ideal"] * 3
    assert "alerts" not in rows[1]
    proc, _ = piped_run
    console = [x for x in proc.stdout.splitlines() if re.fullmatch(line, x)]
    assert sorted(console) == sorted(a["message"] for a in rows[0]["alerts"])
    assert "alerts (logger.alerts): 3 in step 0; by kind: max_over_ideal 3" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_piped_grpo_progress_line_explains_the_loss_and_is_whole(piped_run):
    proc, _ = piped_run
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("GRPO: reward is what improves; pg-loss is the clipped")
    bar = [line for line in lines if line.startswith("grpo_moe_tiny")][-1]
    # Every field of the last step, none cut at 80 columns ("…"): reward first, then pg-loss.
    assert re.search(
        r" 2/2 \d+:\d\d:\d\d reward \d\.\d{3}  pg-loss -?\d\.\d{4}  tok/s \d+  max/ideal \d\.\d\d$",
        bar,
    ), bar
    assert "…" not in bar


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_file_of_the_run_directory_is_in_the_docs_listing_and_readme(piped_run):
    # visualisation.md's listing (en and zh share it) and README's sentence name every entry a
    # real `nemo-moe-metrics run` leaves, the lock file included.
    _, run_dir = piped_run
    entries = {p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()}
    assert {".run.lock", "recipe.yaml", "launch.log", "nemo_run/"} <= entries, entries
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for lang in ("en", "zh"):
        text = (ROOT / "docs" / lang / "visualisation.md").read_text(encoding="utf-8")
        listing = re.search(r"```text\nrun_dir/\n(.*?)```", text, re.S).group(1)
        listed = {w.rstrip(",") for line in listing.splitlines() for w in line.split()[:2]}
        assert entries <= listed, (lang, entries - listed)
    assert not [e for e in entries if f"`{e}`" not in readme], entries
