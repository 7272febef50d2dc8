"""The expert-load store: exact round trip, size, step windows, torn tails, kill -9, bad input."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from nemo_moe_metrics.sinks.store import (
    FORMAT_VERSION,
    STORE_FILE,
    ExpertLoadStore,
    StoreError,
    read_expert_load_blocks,
    read_expert_loads,
    scan_store,
    store_path,
)

REPO = Path(__file__).resolve().parents[2]

HEADER = 36  # bytes of a (version 2) record header


def _counts(rng, layers, experts, tokens):
    p = rng.dirichlet(np.ones(experts), size=layers)
    return np.stack([rng.multinomial(tokens, row) for row in p])


def _write(path, steps, layers=3, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = list(range(1, 2 * layers, 2))
    written = {}
    with ExpertLoadStore(path) as store:
        for step in steps:
            c = _counts(rng, layers, experts, 1000 + step)
            store.append(step, ids, c)
            written[step] = c
    return ids, written


def test_store_path_is_beside_metrics_jsonl(tmp_path):
    assert store_path(tmp_path) == tmp_path / STORE_FILE


def test_counts_and_layer_ids_round_trip_exactly_in_step_order(tmp_path):
    path = store_path(tmp_path)
    ids, written = _write(path, [0, 2, 4, 6])
    got = list(read_expert_loads(path))
    assert [s for s, _, _ in got] == [0, 2, 4, 6]
    for step, layer_ids, counts in got:
        assert layer_ids.tolist() == ids
        assert counts.dtype.kind == "i"
        np.testing.assert_array_equal(counts, written[step])


@pytest.mark.parametrize("top", [0, 255, 65_535, 2**32 - 1, 2**40])
def test_counts_of_every_magnitude_round_trip(tmp_path, top):
    counts = np.array([[top, 0, 1], [3, top, 7]], dtype=np.int64)
    with ExpertLoadStore(store_path(tmp_path)) as store:
        store.append(5, [0, 9], counts)
    [(step, ids, got)] = list(read_expert_loads(store_path(tmp_path)))
    assert (step, ids.tolist()) == (5, [0, 9])
    np.testing.assert_array_equal(got, counts)


def test_a_94x256_step_takes_under_100_kb(tmp_path):
    # 4M tokens x top-8 over 256 experts: ~125k tokens per expert, needs 32-bit counts.
    counts = _counts(np.random.default_rng(1), 94, 256, 4_000_000 * 8)
    path = store_path(tmp_path)
    with ExpertLoadStore(path) as store:
        store.append(0, range(94), counts)
    assert path.stat().st_size < 100_000
    assert path.stat().st_size < counts.size * 4  # smaller than raw int32


def test_step_window_yields_only_those_steps(tmp_path):
    path = store_path(tmp_path)
    _write(path, range(0, 20, 2))
    assert [s for s, _, _ in read_expert_loads(path, slice(4, 10))] == [4, 6, 8]
    assert [s for s, _, _ in read_expert_loads(path, slice(None, 3))] == [0, 2]
    assert [s for s, _, _ in read_expert_loads(path, slice(15, None))] == [16, 18]
    assert [s for s, _, _ in read_expert_loads(path, slice(None, None, 3))] == [0, 6, 12, 18]


def test_step_window_does_not_decode_steps_outside_it(tmp_path):
    path = store_path(tmp_path)
    _write(path, range(4))
    # Garble the payload of step 0: a reader that decoded it would warn about its checksum.
    data = bytearray(path.read_bytes())
    data[8 + HEADER + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [s for s, _, _ in read_expert_loads(path, slice(1, None))] == [1, 2, 3]
    with pytest.warns(UserWarning, match="checksum"):
        assert [s for s, _, _ in read_expert_loads(path)] == [1, 2, 3]


def test_torn_tail_is_skipped_with_a_warning(tmp_path):
    path = store_path(tmp_path)
    _, written = _write(path, range(3))
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - 5)  # the last record lost its end
    with pytest.warns(UserWarning, match="torn"):
        got = list(read_expert_loads(path))
    assert [s for s, _, _ in got] == [0, 1]
    np.testing.assert_array_equal(got[1][2], written[1])


def test_torn_record_header_is_skipped(tmp_path):
    path = store_path(tmp_path)
    _write(path, range(2))
    with path.open("ab") as f:
        f.write(b"ELR1\x05")  # a crash 5 bytes into the next header
    with pytest.warns(UserWarning, match="torn"):
        assert [s for s, _, _ in read_expert_loads(path)] == [0, 1]


def test_reopening_cuts_the_torn_tail_and_appends_after_the_last_complete_step(tmp_path):
    path = store_path(tmp_path)
    _write(path, range(3))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 7)
    with pytest.warns(RuntimeWarning, match="torn by a crash"):
        store = ExpertLoadStore(path)
    store.append(2, [1, 3, 5], np.ones((3, 8), dtype=np.int64))
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing torn any more
        got = list(read_expert_loads(path))
    assert [s for s, _, _ in got] == [0, 1, 2]
    np.testing.assert_array_equal(got[2][2], np.ones((3, 8)))


def test_resumed_store_appends_and_readers_drop_the_abandoned_steps(tmp_path):
    path = store_path(tmp_path)
    _write(path, range(6))
    # A restart from step 3's checkpoint logs steps 3.. again: the first 3, 4, 5 are abandoned.
    with ExpertLoadStore(path) as store:
        for step in (3, 4):
            store.append(step, [7], np.full((1, 2), 100 + step))
    with pytest.warns(UserWarning, match=r"step\(s\) 3–5 stored again later .a restart"):
        got = list(read_expert_loads(path))
    assert [s for s, _, _ in got] == [0, 1, 2, 3, 4]
    assert got[3][2].tolist() == [[103, 103]]
    assert got[3][1].tolist() == [7]


def test_a_file_that_is_not_a_store_is_refused_by_name(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n')
    with pytest.raises(StoreError, match="not an expert-load store"):
        list(read_expert_loads(path))
    with pytest.raises(StoreError, match="not an expert-load store"):
        ExpertLoadStore(path)


def test_missing_store_names_the_settings_that_write_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="track_moe_metrics"):
        list(read_expert_loads(store_path(tmp_path)))


def test_empty_store_yields_nothing(tmp_path):
    ExpertLoadStore(store_path(tmp_path)).close()
    assert list(read_expert_loads(store_path(tmp_path))) == []


_WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from nemo_moe_metrics.sinks.store import ExpertLoadStore
    store = ExpertLoadStore(sys.argv[1])
    step = 0
    while True:
        counts = np.full((94, 256), step, dtype=np.int64)
        counts[:, 0] = 2**33 + step  # 64-bit counts: the biggest records
        store.append(step, range(94), counts)
        print(step, flush=True)  # after append returned
        step += 1
    """
)


def test_kill_9_mid_run_keeps_every_step_whose_append_returned(tmp_path):
    path = store_path(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], env=env, stdout=subprocess.PIPE, text=True
    )
    returned = []
    deadline = time.monotonic() + 120
    while len(returned) < 30 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        returned.append(int(line))
    os.kill(proc.pid, signal.SIGKILL)  # mid-run, probably mid-append
    proc.wait(timeout=30)
    proc.stdout.close()
    assert proc.returncode == -9
    assert len(returned) == 30
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn tail is allowed (and skipped)
        got = list(read_expert_loads(path))
    steps = [s for s, _, _ in got]
    assert steps[: len(returned)] == returned
    assert steps == list(range(len(steps)))  # at most the step being written is missing
    for step, ids, counts in got:
        assert ids.tolist() == list(range(94))
        assert int(counts[3, 7]) == step and int(counts[0, 0]) == 2**33 + step


_SINK_WRITER = textwrap.dedent(
    """
    import sys
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.sinks import build_sinks
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, sys.argv[1], run_name="killed")
    step = 0
    while True:
        rows = [[la, e, step + la + e, 1.0] for la in range(94) for e in range(256)]
        sink.log({"moe/expert_loads": rows, "train_perf/tokens": step}, step)
        print(step, flush=True)  # after log returned
        step += 1
    """
)


def test_kill_9_through_the_sinks_keeps_every_logged_step_in_jsonl_and_store(tmp_path):
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SINK_WRITER, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    returned = []
    deadline = time.monotonic() + 120
    while len(returned) < 10 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        returned.append(int(line))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert len(returned) == 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored = list(read_expert_loads(store_path(tmp_path)))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(x)["step"] for x in lines if x.endswith("}")]
    assert logged[: len(returned)] == returned
    assert [s for s, _, _ in stored][: len(returned)] == returned
    for step, ids, counts in stored:
        assert ids.tolist() == list(range(94))
        expected = step + np.arange(94)[:, None] + np.arange(256)[None, :]
        np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize("workers", [1, 2])
def test_blocks_hold_the_same_steps_and_counts_as_the_step_reader(tmp_path, workers):
    path = store_path(tmp_path)
    rng = np.random.default_rng(5)
    want = []
    with ExpertLoadStore(path) as store:
        for step in range(0, 40, 2):
            # The model changes its MoE layers at step 20: a block must not span the change.
            ids = [3, 1, 5] if step < 20 else [0, 2, 4]
            c = _counts(rng, 3, 8, 70_000 + 1000 * step)  # 3-byte counts: 4-byte planes
            store.append(step, ids, c)
            want.append((step, ids, c))
    got = [
        (int(s), i.tolist(), c)
        for steps, ids, counts in read_expert_load_blocks(path, block=4, workers=workers)
        for s, i, c in zip(steps, [ids] * len(steps), counts, strict=True)
    ]
    assert [(s, i) for s, i, _ in got] == [(s, i) for s, i, _ in want]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(got, want, strict=True))
    blocks = list(read_expert_load_blocks(path, slice(6, 30), block=4, workers=workers))
    assert [b[0].tolist() for b in blocks] == [[6, 8, 10, 12], [14, 16, 18], [20], [22, 24, 26, 28]]
    assert [b[1].tolist() for b in blocks] == [[3, 1, 5]] * 2 + [[0, 2, 4]] * 2


def test_blocks_skip_a_record_failing_its_checksum_with_a_warning(tmp_path):
    path = store_path(tmp_path)
    _, written = _write(path, range(4))
    data = bytearray(path.read_bytes())
    data[8 + HEADER + 2] ^= 0xFF  # the payload of step 0
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum"):
        blocks = list(read_expert_load_blocks(path, workers=2, prepare=lambda s, i, c: (s, c)))
    assert [s.tolist() for s, _ in blocks] == [[1, 2, 3]]
    assert all(np.array_equal(blocks[0][1][k], written[k + 1]) for k in range(3))


# ------------------------------------------------------------------ damage costs one record


def _offsets(path):
    with path.open("rb") as f:
        return {e.step: e.offset for e in scan_store(f).entries}


@pytest.mark.parametrize(
    ("where", "value"),
    [(4, b"\xff\xff\xff\xff"), (24, b"\xff\xff\xff\x7f")],  # the step; the payload size
    ids=["step", "payload_size"],
)
def test_four_bytes_overwritten_in_a_header_cost_that_record_only(tmp_path, where, value):
    path = store_path(tmp_path)
    ids, written = _write(path, range(20))
    at = _offsets(path)[5] + where
    data = bytearray(path.read_bytes())
    data[at : at + 4] = value
    path.write_bytes(bytes(data))
    skipped = []
    got = list(read_expert_loads(path, skipped=skipped))
    assert [s for s, _, _ in got] == [s for s in range(20) if s != 5]
    for step, _, counts in got:
        np.testing.assert_array_equal(counts, written[step])
    [said] = skipped
    assert "between steps 4 and 6: a damaged record, skipped; every record after it is kept" in said
    # A resumed writer keeps every intact record and appends after the last one.
    size = path.stat().st_size
    with pytest.warns(RuntimeWarning, match="between steps 4 and 6"):
        store = ExpertLoadStore(path)
    assert path.stat().st_size == size, "nothing cut"
    store.append(20, ids, written[0])
    store.close()
    with pytest.warns(UserWarning, match="damaged record"):
        assert [s for s, _, _ in read_expert_loads(path)][-3:] == [18, 19, 20]


def fixture_counts(step):
    # tests/fixtures/expert_loads_v1.bin: written by the format-1 writer (commit bf2a8fe) as
    # counts[i, e] = (step + 1) * 7**i * 100**step + 3 * e for layers 1, 3, 5 and 8 experts,
    # steps 0..4 (1-, 2-, 4- and 8-byte counts).
    return np.array(
        [[(step + 1) * 7**i * 100**step + 3 * e for e in range(8)] for i in range(3)],
        dtype=np.int64,
    )


FIXTURE_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "expert_loads_v1.bin"


def test_a_store_written_by_the_first_format_reads_exactly(tmp_path):
    assert FIXTURE_V1.read_bytes()[8:12] == b"ELR1"
    got = list(read_expert_loads(FIXTURE_V1))
    assert [s for s, _, _ in got] == [0, 1, 2, 3, 4]
    for step, ids, counts in got:
        assert ids.tolist() == [1, 3, 5]
        np.testing.assert_array_equal(counts, fixture_counts(step))
    blocks = list(read_expert_load_blocks(FIXTURE_V1, workers=2))
    assert [b[0].tolist() for b in blocks] == [[0, 1, 2, 3, 4]]


def test_a_resumed_first_format_store_gets_new_records_and_reads_both(tmp_path):
    path = store_path(tmp_path)
    path.write_bytes(FIXTURE_V1.read_bytes())
    with ExpertLoadStore(path) as store:
        for step in (5, 6):
            store.append(step, [1, 3, 5], fixture_counts(step - 5) + 1)
    with path.open("rb") as f:
        versions = [e.version for e in scan_store(f).entries]
    assert versions == [1, 1, 1, 1, 1, FORMAT_VERSION, FORMAT_VERSION]
    got = {s: c for s, _, c in read_expert_loads(path)}
    assert sorted(got) == list(range(7))
    np.testing.assert_array_equal(got[4], fixture_counts(4))
    np.testing.assert_array_equal(got[6], fixture_counts(1) + 1)


def test_a_damaged_first_format_header_costs_its_record_only(tmp_path):
    path = store_path(tmp_path)
    data = bytearray(FIXTURE_V1.read_bytes())
    at = _offsets(FIXTURE_V1)[2] + 24  # the payload size of step 2 (format 1 has no header CRC)
    data[at : at + 4] = b"\x05\x00\x00\x00"
    path.write_bytes(bytes(data))
    skipped = []
    assert [s for s, _, _ in read_expert_loads(path, skipped=skipped)] == [0, 1, 3, 4]
    assert "between steps 1 and 3" in skipped[0]


def test_random_bytes_and_cut_headers_are_named_not_a_traceback(tmp_path):
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.report import render_report
    from nemo_moe_metrics.sinks import build_sinks

    sink = build_sinks(LoggerConfig(wandb_enabled=False, table_every=1), tmp_path, run_name="r")
    for step in range(3):
        rows = [[la, e, 10 + step + e, 1.0] for la in (1, 2) for e in range(4)]
        sink.log({"moe/expert_loads": rows, "train_perf/tokens": 1.0}, step)
    sink.close()
    store = store_path(tmp_path)
    store.write_bytes(np.random.default_rng(0).bytes(5000))
    text = render_report(tmp_path, out_dir=tmp_path / "pictures")
    assert "is not an expert-load store (it does not start with" in text
    assert "expert-load pictures (expert_load_heatmap.png" in text
    assert "log them with" not in text, "the flags are on; they are not the problem"
    store.write_bytes(b"NMME")  # cut short before its 8-byte header was whole
    text = render_report(tmp_path, out_dir=tmp_path / "pictures")
    assert f"{store} holds no readable record (4 bytes: cut short" in text
    assert "skipped: expert_loads.bin: the file is shorter than its 8-byte header" in text
    assert "log them with" not in text
