"""Resume: a second run into the same directory continues steps, totals and every sink."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.run_dir.resume import last_record
from nemo_moe_metrics.sinks import RUN_FILE, TENSORBOARD_DIR, build_sinks, read_resume_state
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path
from nemo_moe_metrics.throughput import StepMeter

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
SFT = CONFIGS / "sft_moe_tiny.yaml"


def wandb_history(run_dir: Path) -> list[tuple[str, dict]]:
    """(run id, history row) for every row in every offline run under ``run_dir/wandb``.

    Reads W&B's transaction log directly: a 7-byte file header, then LevelDB log records
    (crc32c:4, length:2, type:1; FULL=1, FIRST=2, MIDDLE=3, LAST=4) in 32 KiB blocks, each
    record a ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, pending, run_id = 7, b"", None
        while pos + 7 <= len(data):
            block_left = 32768 - pos % 32768
            if block_left < 7:  # block trailer padding
                pos += block_left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk = data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind == 0 and length == 0:
                continue
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind not in (1, 4):
                continue
            record = pb.Record()
            record.ParseFromString(pending)
            which = record.WhichOneof("record_type")
            if which == "run":
                run_id = record.run.run_id
            elif which == "history":
                row = {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append((run_id, row))
    return rows


def _train(rank, world_size, out_dir, overrides):
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.train import train

    recipe = load_recipe(SFT, ["logger.table_every=1", *overrides])
    train(recipe, out_dir)
    return rank


@pytest.mark.timeout(600)
def test_resumed_run_continues_steps_totals_and_every_sink(tmp_path):
    # Two ranks (expert parallel 2, as the recipe says): the resume state is broadcast.
    ok_values(run_ranks(_train, 2, str(tmp_path), ["training.max_steps=3"], timeout=300))
    first = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["run_id"]
    resume = ["training.max_steps=5", "logger.resume=true"]
    ok_values(run_ranks(_train, 2, str(tmp_path), resume, timeout=300))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    # JSONL: steps 0..4 once each; the first three lines are untouched.
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[:3] == first
    # Totals continue: each total is the running sum of the per-step values (all five steps).
    tokens = np.cumsum([r[mn.TOKENS] for r in records])
    seconds = np.cumsum([r[mn.SECONDS] for r in records])
    flops = np.cumsum([r[mn.ESTIMATED_FLOPS] for r in records])
    np.testing.assert_allclose([r[mn.TOTAL_TOKENS] for r in records], tokens)
    np.testing.assert_allclose([r[mn.TOTAL_SECONDS] for r in records], seconds, rtol=1e-9)
    np.testing.assert_allclose(
        [r[mn.CUMULATIVE_TOKENS_PER_SECOND] for r in records], tokens / seconds, rtol=1e-9
    )
    np.testing.assert_allclose(
        [r[mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND] for r in records],
        flops / seconds,
        rtol=1e-9,
    )
    assert records[3][mn.TOTAL_TOKENS] > records[3][mn.TOKENS]  # not restarted at 0

    # Store: one record per step, no repeats, tables of both processes.
    assert [s for s, _, _ in read_expert_loads(store_path(tmp_path))] == [0, 1, 2, 3, 4]

    # TensorBoard: one point per step for a scalar, across both processes' event files.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(mn.TOTAL_TOKENS)
    assert [e.step for e in events] == [0, 1, 2, 3, 4]
    np.testing.assert_allclose([e.value for e in events], tokens, rtol=1e-6)

    # W&B offline: both processes wrote the same run id; the steps are contiguous, no repeat.
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == run_id
    history = wandb_history(tmp_path)
    assert {rid for rid, _ in history} == {run_id}
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
    steps = [row["_step"] for _, row in history if mn.TOTAL_TOKENS in row]
    assert steps == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(
        [row[mn.TOTAL_TOKENS] for _, row in history if mn.TOTAL_TOKENS in row], tokens
    )


def test_resume_state_is_the_last_complete_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 6, mn.TOTAL_TOKENS: 100.0, mn.TOTAL_SECONDS: 4.0})
        + "\n"
        + json.dumps(
            {
                "step": 7,
                mn.TOTAL_TOKENS: 150.0,
                mn.TOTAL_SECONDS: 5.0,
                mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND: 3e9,
            }
        )
        + "\n"
        + '{"step": 8, "train_perf/tot'  # torn by a crash
    )
    state = read_resume_state(tmp_path)
    assert (state.last_step, state.next_step) == (7, 8)
    assert (state.total_tokens, state.total_seconds) == (150.0, 5.0)
    assert state.total_flops == pytest.approx(3e9 * 5.0)


def test_resume_state_of_an_empty_directory_starts_at_step_0(tmp_path):
    state = read_resume_state(tmp_path)
    assert (state.last_step, state.next_step, state.total_tokens) == (None, 0, 0.0)


def test_last_record_finds_a_line_longer_than_the_read_chunk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    big = {"step": 3, **{f"moe/layer_{i}/max_over_ideal": 1.0 + i for i in range(20_000)}}
    path.write_text(json.dumps({"step": 2}) + "\n" + json.dumps(big) + "\n")
    assert path.stat().st_size > 1 << 18
    assert last_record(path) == big


def test_step_meter_resume_continues_totals_and_cumulative_rates():
    clock = iter([0.0, 2.0]).__next__
    meter = StepMeter(clock=clock)
    meter.resume(total_tokens=1000, total_seconds=10.0)
    import torch

    with meter.step():
        meter.add_sequences(torch.tensor([30, 20]))
    out = meter.export()
    assert out[mn.TOKENS] == 50 and out[mn.SECONDS] == 2.0
    assert out[mn.TOTAL_TOKENS] == 1050 and out[mn.TOTAL_SECONDS] == 12.0
    assert out[mn.CUMULATIVE_TOKENS_PER_SECOND] == pytest.approx(1050 / 12)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "5"])
def test_step_meter_resume_refuses_bad_totals(bad):
    with pytest.raises(ValueError, match="finite number >= 0"):
        StepMeter().resume(total_tokens=bad, total_seconds=1.0)


def test_tensorboard_resume_hides_steps_an_earlier_process_wrote_ahead(tmp_path):
    # TensorBoard got steps 0..4 on disk, the JSONL only 0..2 (its last lines were lost).
    cfg = LoggerConfig(wandb_enabled=False)
    sink = build_sinks(cfg, tmp_path, run_name="r")
    for step in range(5):
        sink.log({mn.TOKENS: step}, step)
    sink.close()
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(jsonl.read_text().splitlines(keepends=True)[:3]))

    resumed = LoggerConfig(wandb_enabled=False, resume=True)
    sink = build_sinks(resumed, tmp_path, run_name="r")
    for step in (3, 4):
        sink.log({mn.TOKENS: 100 + step}, step)
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars(mn.TOKENS)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 103.0),
        (4, 104.0),
    ]


def test_run_without_resume_gets_a_new_run_id_and_resume_keeps_it(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    build_sinks(cfg, tmp_path, run_name="r").close()
    first = json.loads((tmp_path / RUN_FILE).read_text())
    build_sinks(cfg.model_copy(update={"resume": True}), tmp_path, run_name="r").close()
    resumed = json.loads((tmp_path / RUN_FILE).read_text())
    assert resumed["run_id"] == first["run_id"]
    assert resumed["created"] == first["created"]
    assert len(resumed["resumed"]) == 1
    build_sinks(cfg, tmp_path, run_name="r").close()
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] != first["run_id"]


def test_logger_resume_and_table_every_come_from_the_recipe_overrides():
    from nemo_moe_metrics.config import DEFAULT_TABLE_EVERY, load_recipe

    recipe = load_recipe(SFT, ["logger.resume=true", "logger.table_every=7"])
    assert recipe.logger.resume is True
    assert recipe.logger.table_every == 7
    assert recipe.logger.wandb_table_cadence == 7  # W&B follows table_every when unset
    assert LoggerConfig().table_every == DEFAULT_TABLE_EVERY == 20
    assert LoggerConfig(wandb_table_every=3).wandb_table_cadence == 3


def test_table_every_zero_is_refused_by_name():
    from nemo_moe_metrics.config import ConfigError, recipe_from_dict

    with pytest.raises(ConfigError, match=r"logger\.table_every: .*greater than or equal to 1"):
        recipe_from_dict({"policy": {"model": {}}, "logger": {"table_every": 0}})


# ------------------------------------------------------------ the records agree before resuming


def _log(run_dir, steps, *, table_steps=None, cfg=None):
    cfg = cfg or LoggerConfig(wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, run_dir, run_name="r")
    for step in steps:
        metrics = {mn.TOKENS: 10.0 + step, mn.TOTAL_TOKENS: 100.0 * (step + 1)}
        if table_steps is None or step in table_steps:
            metrics[mn.EXPERT_LOADS] = [[1, e, step + e, 1.0] for e in range(4)]
        sink.log(metrics, step)
    sink.close()


def _jsonl_steps(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _raw_store_steps(run_dir):
    from nemo_moe_metrics.sinks.store import scan_store

    with store_path(run_dir).open("rb") as f:
        return scan_store(f).steps


def test_a_logged_step_whose_store_record_is_missing_is_logged_again(tmp_path):
    from nemo_moe_metrics.sinks import prepare_resume

    _log(tmp_path, range(6), table_steps={0, 1, 2, 3})  # steps 4, 5: their counts were lost
    state, notes = prepare_resume(tmp_path, table_every=1)
    assert state.next_step == 4 and state.total_tokens == 400.0
    [note] = notes
    assert "step(s) 4–5 have no record in expert_loads.bin" in note
    assert "cut, and logged again from step 4" in note
    assert _jsonl_steps(tmp_path) == [0, 1, 2, 3]
    _log(tmp_path, range(4, 6), cfg=LoggerConfig(wandb_enabled=False, table_every=1, resume=True))
    assert _jsonl_steps(tmp_path) == list(range(6))
    assert _raw_store_steps(tmp_path) == list(range(6))


def test_store_records_past_the_last_jsonl_step_are_cut_and_logged_again(tmp_path):
    from nemo_moe_metrics.sinks import prepare_resume
    from nemo_moe_metrics.sinks.store import ExpertLoadStore

    _log(tmp_path, range(4))
    with ExpertLoadStore(store_path(tmp_path)) as store:  # killed after the store, before JSONL
        store.append(4, [1], np.array([[9, 9, 9, 9]]))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step":4,"train_perf/tok')  # ... while writing its JSONL line
    state, notes = prepare_resume(tmp_path, table_every=1)
    assert state.next_step == 4
    assert "cut a torn last line" in notes[0]
    assert (
        "expert_loads.bin: step(s) 4 stored after the last complete step of metrics.jsonl"
        in (notes[1])
    )
    _log(tmp_path, [4, 5], cfg=LoggerConfig(wandb_enabled=False, table_every=1, resume=True))
    assert _jsonl_steps(tmp_path) == list(range(6))  # no torn line left either
    assert _raw_store_steps(tmp_path) == list(range(6))
    counts = {s: c for s, _, c in read_expert_loads(store_path(tmp_path))}
    assert counts[4].tolist() == [[4, 5, 6, 7]]  # the logged-again step, not the cut one


def test_a_step_line_appended_by_hand_is_said_by_resume_and_report(tmp_path):
    from nemo_moe_metrics.report import render_report
    from nemo_moe_metrics.sinks import prepare_resume

    _log(tmp_path, range(24))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5}\n')
    summary = render_report(tmp_path, out_dir=tmp_path / "pictures")
    assert "run r: steps 0–5 (6 logged)" in summary
    assert (
        "skipped: metrics.jsonl: steps 5–23 (19 logged) superseded: line 25 logs step 5 again"
        in summary
    )
    _, notes = prepare_resume(tmp_path, table_every=1)
    assert "its last line logs step 5 after step 23" in notes[0]


def test_resume_with_an_empty_jsonl_beside_tensorboard_steps_is_refused(tmp_path):
    from nemo_moe_metrics.sinks import ResumeError, logged_run

    _log(tmp_path, range(3), table_steps=set())
    (tmp_path / "metrics.jsonl").write_text("")
    assert logged_run(tmp_path) == ["tensorboard"]  # a damaged run, not one that died early
    with pytest.raises(ResumeError) as err:
        build_sinks(LoggerConfig(wandb_enabled=False, resume=True), tmp_path, run_name="r")
    assert f"--resume: {tmp_path / 'metrics.jsonl'} is empty, but logged steps remain in " in str(
        err.value
    )
    assert "tensorboard/ (scalar events): the step to continue from is unknown" in str(err.value)
    assert "Restore metrics.jsonl (from a backup), or start afresh with --overwrite" in str(
        err.value
    )


def test_a_deleted_run_json_gets_its_run_id_back_from_the_wandb_folder(tmp_path):
    _log(tmp_path, range(2))
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["run_id"]
    (tmp_path / "wandb" / f"offline-run-20261204_101010-{run_id}").mkdir(parents=True)
    (tmp_path / RUN_FILE).unlink()
    with pytest.warns(RuntimeWarning, match=f"the run id {run_id} was recovered from wandb"):
        _log(tmp_path, [2], cfg=LoggerConfig(wandb_enabled=False, resume=True))
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == run_id
    (tmp_path / RUN_FILE).unlink()
    for folder in (tmp_path / "wandb").iterdir():
        folder.rmdir()
    with pytest.warns(RuntimeWarning, match="W&B and MLflow .if on. start new runs"):
        _log(tmp_path, [3], cfg=LoggerConfig(wandb_enabled=False, resume=True))


def test_resume_keeps_a_complete_non_record_last_line(tmp_path):
    from nemo_moe_metrics.sinks import prepare_resume

    text = '{"step": 0, "train_perf/total_tokens": 8.0}\n{"note": "paused by hand"}\n'
    (tmp_path / "metrics.jsonl").write_text(text)
    state, notes = prepare_resume(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == text
    assert state.last_step == 0 and state.total_tokens == 8.0
    assert not [n for n in notes if "torn" in n]
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 1, "train_p')  # a torn write
    _, notes = prepare_resume(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == text
    assert any("cut a torn last line" in n for n in notes)


def test_a_non_finite_total_tokens_in_the_last_line_is_an_error_not_a_restart(tmp_path):
    from nemo_moe_metrics.sinks import ResumeError, prepare_resume

    text = (
        '{"step": 0, "train_perf/total_tokens": 8.0}\n'
        '{"step": 1, "train_perf/total_tokens": null}\n'
    )
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ResumeError, match=r"step 1\) holds train_perf/total_tokens = null"):
        prepare_resume(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == text
