"""The JSONL sink (sinks/jsonl.py): one object of scalars per step (the table goes to the store),
every completed step kept through a kill, resume after a torn line, abandoned steps dropped by
readers, NaN and inf written as null."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report import read_metrics
from nemo_moe_metrics.sinks import METRICS_FILE, build_sinks
from nemo_moe_metrics.sinks.jsonl import JsonlSink
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

REPO = Path(__file__).resolve().parents[2]

JSONL_ONLY = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)


def jsonl_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_one_object_of_scalars_per_step_and_the_table_goes_to_the_store(tmp_path):
    table = [[0, e, 10 * e, 100 * e / 280] for e in range(8)] + [[4, 1, 9, 100.0]]
    sink = build_sinks(JSONL_ONLY.model_copy(update={"table_every": 1}), tmp_path, run_name="r")
    sink.log({mn.MAX_OVER_IDEAL: 1.25, mn.TOKENS: 512, mn.EXPERT_LOADS: table}, step=3)
    sink.log({mn.MAX_OVER_IDEAL: 1.5}, step=4)
    sink.close()
    assert jsonl_lines(tmp_path / METRICS_FILE) == [
        {"step": 3, mn.MAX_OVER_IDEAL: 1.25, mn.TOKENS: 512},
        {"step": 4, mn.MAX_OVER_IDEAL: 1.5},
    ]
    [(step, layer_ids, counts)] = list(read_expert_loads(store_path(tmp_path)))
    assert step == 3 and layer_ids.tolist() == [0, 4]
    assert counts.tolist() == [[10 * e for e in range(8)], [0, 9, 0, 0, 0, 0, 0, 0]]


def test_table_goes_to_the_store_every_table_every_steps_and_scalars_every_step(tmp_path):
    sink = build_sinks(JSONL_ONLY.model_copy(update={"table_every": 3}), tmp_path, run_name="r")
    for step in range(8):
        sink.log({mn.TOKENS: step, mn.EXPERT_LOADS: [[2, 0, step, 100.0]]}, step)
    sink.close()
    assert [r["step"] for r in jsonl_lines(tmp_path / METRICS_FILE)] == list(range(8))
    stored = [(s, c.tolist()) for s, _, c in read_expert_loads(store_path(tmp_path))]
    # ... and the last step's table when the run closes, off the cadence (a short run has one)
    assert stored == [(0, [[0]]), (3, [[3]]), (6, [[6]]), (7, [[7]])]


def test_jsonl_keeps_every_completed_step_when_the_process_is_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal
        from nemo_moe_metrics.sinks.jsonl import JsonlSink
        sink = JsonlSink({str(tmp_path / METRICS_FILE)!r})
        for step in range(5):
            sink.log({{"train_perf/tokens": 100 + step}}, step)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run: no close(), no atexit
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr
    assert jsonl_lines(tmp_path / METRICS_FILE) == [
        {"step": s, "train_perf/tokens": 100 + s} for s in range(5)
    ]


def test_resume_after_a_torn_line_appends_on_a_fresh_line(tmp_path):
    path = tmp_path / METRICS_FILE
    good = '{"step":0,"moe/max_over_ideal":1.1}\n{"step":1,"moe/max_over_ideal":1.2}\n'
    path.write_text(good + '{"step":2,"moe/max_ov')  # killed in the middle of step 2's line
    sink = JsonlSink(path)
    sink.log({mn.MAX_OVER_IDEAL: 1.3}, step=2)
    sink.close()
    with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
        records = read_metrics(path)
    assert [(r["step"], r[mn.MAX_OVER_IDEAL]) for r in records] == [(0, 1.1), (1, 1.2), (2, 1.3)]


def test_resumed_run_appends_and_readers_drop_the_abandoned_steps(tmp_path):
    # First run logs steps 0..3 and dies; the second resumes from a checkpoint at step 2.
    for again, values in enumerate(({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {2: 30.0, 3: 40.0, 4: 50.0})):
        sink = build_sinks(
            JSONL_ONLY.model_copy(update={"resume": bool(again)}), tmp_path, run_name="r"
        )
        for step, v in values.items():
            sink.log({mn.MAX_OVER_IDEAL: v}, step)
        sink.close()
    assert len(jsonl_lines(tmp_path / METRICS_FILE)) == 7  # appended, nothing overwritten
    with pytest.warns(UserWarning, match="steps 2–3 .2 logged. superseded: line 5 logs step 2"):
        records = read_metrics(tmp_path / METRICS_FILE)
    assert [(r["step"], r[mn.MAX_OVER_IDEAL]) for r in records] == [
        (0, 1.0),
        (1, 2.0),
        (2, 30.0),
        (3, 40.0),
        (4, 50.0),
    ]


def test_restart_earlier_than_the_last_step_discards_the_later_abandoned_steps(tmp_path):
    for again, values in enumerate(({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {2: 30.0})):
        sink = build_sinks(
            JSONL_ONLY.model_copy(update={"resume": bool(again)}), tmp_path, run_name="r"
        )
        for step, v in values.items():
            sink.log({mn.MAX_OVER_IDEAL: v}, step)
        sink.close()
    with pytest.warns(UserWarning, match="steps 2–3 .2 logged. superseded"):
        records = read_metrics(tmp_path / METRICS_FILE)
    assert [(r["step"], r[mn.MAX_OVER_IDEAL]) for r in records] == [(0, 1.0), (1, 2.0), (2, 30.0)]


def test_nan_and_inf_are_written_as_json_null(tmp_path):
    sink = JsonlSink(tmp_path / METRICS_FILE)
    sink.log({mn.aux_loss_key("z_loss"): math.nan, mn.MFU: math.inf, mn.TOKENS: 1}, step=0)
    sink.close()
    text = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert jsonl_lines(tmp_path / METRICS_FILE) == [
        {"step": 0, "moe/z_loss": None, "train_perf/mfu": None, "train_perf/tokens": 1}
    ]
