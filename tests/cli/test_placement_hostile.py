"""``placement`` and ``ingest sglang`` on hostile inputs, through the real CLI: declared sizes
bounded before anything is allocated (each bounded case's peak memory measured in a child),
counts that never wrap, and every input error one line naming the file and the fix."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile_files import PEAK_LIMIT_MB, cli_peak_mb, fingerprint, wide_record

from nemo_moe_metrics.cli import main
from nemo_moe_metrics.sinks.store import ExpertLoadStore, StoreError, store_path

pytestmark = pytest.mark.one_line

E = 8


def _store(run_dir: Path, steps: range = range(8), layers=(1, 2)) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [f'{{"step":{s},"train_perf/tokens":8.0}}\n' for s in steps]
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    rng = np.random.default_rng(1)
    with ExpertLoadStore(store_path(run_dir), fsync=False) as store:
        for step in steps:
            store.append(step, list(layers), rng.integers(1, 100, size=(len(layers), E)))
    return run_dir


def _one_line(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def _dump(path: Path, count: torch.Tensor) -> Path:
    torch.save({"rank": 0, "logical_count": count}, path)
    return path


# --- 3. bounded work and memory -----------------------------------------------------------


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--redundant-experts", "4000"], ["--redundant-experts 4,000", "limit of 16"]),
        (["--sweep", "--sweep-max", "1000000000"], ["--sweep-max 1,000,000,000", "limit of 16"]),
    ],
)
def test_redundancy_and_sweep_range_are_bounded_before_any_plan(tmp_path, flags, words):
    _store(tmp_path)
    peak, rc, said = cli_peak_mb("placement", str(tmp_path), "--ep-size", "2", *flags)
    assert rc == 2 and "Traceback" not in said, said
    assert all(w in said for w in words) and "NEMO_MOE_METRICS_MAX_REDUNDANCY" in said, said
    assert peak < PEAK_LIMIT_MB, peak
    print(f"peak {peak:.0f} MB: placement {' '.join(flags)}")


def test_the_redundancy_limit_is_raised_by_its_variable(tmp_path, capsys, monkeypatch):
    _store(tmp_path)
    argv = ["placement", str(tmp_path), "--ep-size", "2", "--redundant-experts", "24"]
    _one_line(capsys, argv, "NEMO_MOE_METRICS_MAX_REDUNDANCY")
    monkeypatch.setenv("NEMO_MOE_METRICS_MAX_REDUNDANCY", "3")
    assert main(argv) == 0


@pytest.mark.parametrize(
    "shape,words",
    [
        ((100_000, 2, E), ["repeats 4 bytes of storage", "strides (0, 0, 0)"]),  # 1.0 GB int64
        ((100_000, 1024, 1024), ["1,048,576 layer x expert cells", "NEMO_MOE_METRICS_MAX_CELLS"]),
    ],
)
def test_a_dump_made_with_expand_is_refused_before_it_is_read(tmp_path, shape, words):
    dump = _dump(tmp_path / "d.pt", torch.ones(1, 1, 1, dtype=torch.int32).expand(*shape))
    assert dump.stat().st_size < 4096
    run = tmp_path / "run"
    argv = ("ingest", "sglang", str(dump), "--run", str(run), "--step", "1")
    peak, rc, said = cli_peak_mb(*argv)
    assert rc == 2 and "Traceback" not in said and all(w in said for w in words), said
    assert str(dump) in said and not run.exists()
    assert peak < PEAK_LIMIT_MB, peak
    print(f"peak {peak:.0f} MB: ingest of an expand()ed {list(shape)} dump")


# --- 4. numbers that never wrap ------------------------------------------------------------


def test_a_count_of_2_64_minus_1_is_refused_on_append_and_skipped_on_read(tmp_path, capsys):
    run = _store(tmp_path / "run")
    with (
        ExpertLoadStore(store_path(run), fsync=False) as store,
        pytest.raises(StoreError, match="layer 2 expert 3 has a count of 18,446,744,073,709"),
    ):
        store.append(8, [1, 2], np.array([[0] * E, [0, 0, 0, 2**64 - 1] + [0] * 4], np.uint64))
    counts = np.zeros((2, E), np.uint64)
    counts[1, 3] = 2**64 - 1
    with store_path(run).open("ab") as f:  # a foreign writer's record, checksums valid
        f.write(wide_record(8, counts, [1, 2]))
    assert main(["placement", str(run), "--ep-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 8: layer 2 expert 3 holds a count of 18,446,744,073,709,551,615" in out
    assert "steps 0–7 (8 logged" in out  # planned from the readable steps only
    assert main(["report", str(run), "--out", str(tmp_path / "p")]) == 0
    assert "step 8: layer 2 expert 3" in capsys.readouterr().out


def test_four_steps_of_2_62_are_skipped_not_summed_into_zero(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    counts = np.full((2, E), 2**62, np.uint64)
    store_path(run).write_bytes(b"NMMELS1\n" + b"".join(wide_record(s, counts) for s in range(4)))
    _one_line(capsys, ["placement", str(run), "--ep-size", "2"], "no stored train step")
    # Counts each below 2**53, summed over 1,100 steps: the sum is checked, never wrapped.
    big = np.zeros((1, E), np.int64)
    big[0, 5] = 2**53 - 1
    _store_all(run, {s: big for s in range(1100)})
    _one_line(capsys, ["placement", str(run), "--ep-size", "2"], "layer 0", "pass 2**62", "--steps")
    assert main(["placement", str(run), "--ep-size", "2", "--steps", "0-99"]) == 0
    assert f"{100 * (2**53 - 1):,} expert-tokens" in capsys.readouterr().out
    assert main(["report", str(run), "--steps", "0:", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "layer 0's tokens summed over steps 0–" in err and "pass 2**62" in err, err


def _store_all(run: Path, counts: dict[int, np.ndarray]) -> None:
    (run / "metrics.jsonl").write_text("".join(f'{{"step":{s}}}\n' for s in counts))
    store_path(run).unlink(missing_ok=True)
    with ExpertLoadStore(store_path(run), fsync=False) as store:
        for step, c in counts.items():
            store.append(step, [0], c)


def test_dump_counts_and_their_sums_over_passes_are_checked(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["ingest", "sglang", "--run", str(run), "--step", "1"]
    huge = torch.zeros(4, 2, E, dtype=torch.int64)
    huge[2, 1, 6] = 2**62
    dump = _dump(tmp_path / "huge.pt", huge)
    _one_line(capsys, [*argv[:2], str(dump), *argv[2:]], "pass 2, layer 1, expert 6", "2**53")
    four = torch.zeros(4, 2, E, dtype=torch.int64)
    four[:, 1, 6] = 2**52
    dump = _dump(tmp_path / "four.pt", four)
    _one_line(capsys, [*argv[:2], str(dump), *argv[2:]], "layer 1 expert 6 sums to", "4 passes")
    assert not run.exists()


def test_a_step_above_2_64_is_one_line(tmp_path, capsys):
    dump = _dump(tmp_path / "d.pt", torch.ones(1, 2, E, dtype=torch.int32))
    argv = ["ingest", "sglang", str(dump), "--run", str(tmp_path / "run"), "--step", str(2**64 + 1)]
    _one_line(capsys, argv, "--step", "outside 0..2**53-1")


# --- 5. one line naming the file -----------------------------------------------------------


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_code_carrying_dump_names_the_refused_global_not_torchs_advice(tmp_path, capsys):
    payload = _Payload()
    payload.marker = tmp_path / "ran"
    dump = tmp_path / "evil.pt"
    torch.save({"logical_count": payload}, dump)  # the zip format SGLang writes
    argv = ["ingest", "sglang", str(dump), "--run", str(tmp_path / "run"), "--step", "1"]
    err = _one_line(capsys, argv, str(dump), "global posix.system", "refused")
    assert "weights_only=False" not in err and "Re-running" not in err
    with dump.open("wb") as f:  # and a bare pickle: read from its opcodes, never unpickled
        pickle.dump({"logical_count": payload}, f, protocol=2)
    _one_line(capsys, argv, "names the global posix.system")
    assert not payload.marker.exists()


@pytest.mark.parametrize(
    "content,words",
    [
        (b"hello, this is a text file\n" * 20, ["not a file torch.save writes", "b'hello, "]),
        (b"", ["the file is empty (0 bytes)"]),
        (None, ["is a directory"]),
        ("missing", ["not found"]),
    ],
)
def test_what_is_not_a_dump_is_one_line_naming_it(tmp_path, capsys, content, words):
    dump = tmp_path / "d.pt"
    if content is None:
        dump.mkdir()
    elif isinstance(content, bytes):
        dump.write_bytes(content)
    argv = ["ingest", "sglang", str(dump), "--run", str(tmp_path / "run"), "--step", "1"]
    _one_line(capsys, argv, str(dump), *words)


def test_a_store_that_is_not_one_is_named_by_its_path(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollout_expert_loads.bin").write_text("not a store\n")
    before = fingerprint(run)
    dump = _dump(tmp_path / "d.pt", torch.ones(1, 2, E, dtype=torch.int32))
    argv = ["ingest", "sglang", str(dump), "--run", str(run), "--step", "1"]
    err = _one_line(capsys, argv, str(run / "rollout_expert_loads.bin"), "not an expert-load store")
    assert " 3 is not" not in err and " 4 is not" not in err
    assert fingerprint(run) == before


def test_an_ep_size_that_does_not_divide_the_experts_suggests_only_divisors(tmp_path, capsys):
    _store(tmp_path)
    err = _one_line(capsys, ["placement", str(tmp_path), "--ep-size", "16"], "1, 2, 4, 8")
    assert "24" not in err and "--redundant-experts" not in err
