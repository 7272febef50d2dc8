#!/usr/bin/env python
"""Issue 52's faults and hostile inputs, each through the real CLI in a process of its own.

    python benchmarks/hostile_inputs.py [--json out.json] [--disk-full-at-end]
    python benchmarks/fault_injection.py --rounds 0 --hostile-inputs

Every case builds what a careful user or an attacker would give a command (a file where the
plan goes, a link, a user's directory, a 1.7 KB dump that declares 100,000 passes, a store
record declaring a 16384 x 16384 table, a count of 2**64-1, a line logging step -5, a recipe
with a key twice, ...), runs the command, and checks what it said (one line, no traceback,
the words that name the problem), that the user's files are byte-identical (sha256 before
and after) and, for the bounded cases, the command's peak memory (under
:data:`PEAK_LIMIT_MB`). ``--disk-full-at-end`` (root: a tmpfs) also trains the tiny recipe
and fills the disk after its last step: the run must say that no rank failed and name the
files. The tests (tests/run_dir/test_outputs.py, cli/test_placement_hostile.py,
sinks/test_store_format.py, report/test_reading.py, run_dir/test_record_cli.py, ...) hold the same
cases; the helpers here are theirs too (tests/support/hostile_files.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
#: The most memory a bounded case may take: the command's peak resident set.
PEAK_LIMIT_MB = 512
RECIPE = REPO / "examples" / "configs" / "sft_moe_tiny.yaml"

# One command, then its own peak (ru_maxrss is a peak: one process per measured case).
_PEAK = (
    "import resource, sys\n"
    "from nemo_moe_metrics.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc, flush=True)\n"
)


def fingerprint(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (links as ``-> target``, never followed)."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


def cli_peak_mb(*args: str, timeout: float = 120) -> tuple[float, int, str]:
    """Run ``nemo-moe-metrics ARGS`` in a child; ``(peak MB, exit status, stdout+stderr)``.

    The child is forked by a small shell, not by the caller: Linux keeps a process's peak
    across ``execve`` (``ru_maxrss`` of a child forked by a large process starts at that
    process's size), and a shell that runs one more command after it must fork, not exec."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg", "COLUMNS": "160"}
    proc = subprocess.run(
        ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", _PEAK, *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PEAK_KB")), None)
    if line is None:
        return 0.0, proc.returncode or 1, said
    _, kb, rc = line.split()
    return int(kb) / 1024, int(rc), said


def record(
    step: int,
    layer_ids: Iterable[int],
    planes: Iterable[bytes],
    layers: int,
    experts: int,
    itemsize: int,
) -> bytes:
    """One version-2 store record, written from the format in ``store_format``'s docstring
    (not with the store's encoder): header, its checksum, zlib(ids, shuffled count planes)."""
    packer = zlib.compressobj(9)
    payload = packer.compress(np.asarray(list(layer_ids), "<i4").tobytes())
    for chunk in planes:
        payload += packer.compress(chunk)
    payload += packer.flush()
    head = struct.pack(
        "<4sQIIBBHII", b"ELR2", step, layers, experts, itemsize, 1, 0, len(payload),
        zlib.crc32(payload),
    )  # fmt: skip
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def wide_record(step: int, counts: np.ndarray, layer_ids: Iterable[int] | None = None) -> bytes:
    """A record of 8-byte counts ``[L, E]`` (any uint64 value, as a foreign writer may)."""
    arr = np.asarray(counts, dtype="<u8")
    planes = np.ascontiguousarray(arr.reshape(-1).view(np.uint8).reshape(-1, 8).T)
    ids = range(arr.shape[0]) if layer_ids is None else layer_ids
    return record(step, ids, [planes.tobytes()], arr.shape[0], arr.shape[1], 8)


def square_zero_record(step: int, n: int) -> bytes:
    """An honest record declaring an ``n x n`` table of zeros (1-byte counts): small on disk,
    ``8 n**2`` bytes once decoded into int64."""
    zero = b"\0" * (1 << 20)
    return record(step, range(n), (zero for _ in range((n * n) >> 20)), n, n, 1)


# --- the cases ------------------------------------------------------------------------------


def _run_dir(path: Path, steps: int = 8) -> Path:
    """A small run directory as the sinks write it: metrics.jsonl, run.json, the store."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = "".join(f'{{"step":{s},"train_perf/tokens":8.0}}\n' for s in range(steps))
    (path / "metrics.jsonl").write_text(lines)
    (path / "run.json").write_text('{"run_id": "x", "run_name": "r", "config": {}}\n')
    body = b"".join(wide_record(s, rng.integers(1, 100, size=(2, 8)), [1, 2]) for s in range(steps))
    (path / "expert_loads.bin").write_bytes(b"NMMELS1\n" + body)
    return path


def _dump(path: Path, count_expr: str) -> Path:
    """An SGLang-style dump whose ``logical_count`` is the torch expression ``count_expr``."""
    code = (
        "import sys, torch\n"
        f"torch.save({{'rank': 0, 'logical_count': {count_expr}}}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    return path


Case = Callable[[Path], tuple[tuple[str, ...], int, list[str], Path | None, bool]]


def _cases() -> dict[str, Case]:
    """name -> build(root): ``(argv, exit status expected, words expected, a folder whose
    files must stay byte-identical or None, whether its peak memory is measured)``."""
    place = ("placement",)

    def out_exists(root):
        run = _run_dir(root / "run")
        (root / "mine").mkdir()
        (root / "mine" / "PLAN.json").write_text("mine\n")
        argv = (*place, str(run), "--ep-size", "2", "--out", str(root / "mine" / "PLAN.json"))
        return argv, 2, ["exists; pass --force"], root / "mine", False

    def out_link(root):
        run = _run_dir(root / "run")
        (root / "user").mkdir()
        (root / "user" / "precious").write_text("keep\n")
        (root / "user" / "PLAN.json").symlink_to(root / "user" / "precious")
        argv = (
            *place,
            str(run),
            "--ep-size",
            "2",
            "--force",
            "--out",
            str(root / "user" / "PLAN.json"),
        )
        return argv, 2, ["symbolic link"], root / "user", False

    def out_siblings(root):
        run = _run_dir(root / "run")
        (root / "user").mkdir()
        for name in ("PLAN.sglang.json", "PLAN.vllm_eplb_config.json", "placement_sweep.png"):
            (root / "user" / name).write_text("mine\n")
        argv = (
            *place,
            str(run),
            "--ep-size",
            "2",
            "--sweep",
            "--out",
            str(root / "user" / "PLAN.json"),
        )
        return argv, 0, ["wrote"], None, False

    def out_run_file(root):
        run = _run_dir(root / "run")
        argv = (*place, str(run), "--ep-size", "2", "--force", "--out", str(run / "metrics.jsonl"))
        return argv, 2, ["the run's own files"], run, False

    def out_directory(root):
        run = _run_dir(root / "run")
        return (
            (*place, str(run), "--ep-size", "2", "--out", str(root)),
            2,
            ["a directory"],
            None,
            False,
        )

    def ingest_user_dir(root):
        (root / "user" / ".git").mkdir(parents=True)
        (root / "user" / "notes.txt").write_text("mine\n")
        dump = _dump(root / "d.pt", "torch.ones(1, 2, 8, dtype=torch.int32)")
        argv = ("ingest", "sglang", str(dump), "--step", "1", "--run", str(root / "user"))
        return argv, 2, ["not a run directory"], root / "user", False

    def run_resume_user_dir(root):
        (root / "out" / "sft_moe_tiny").mkdir(parents=True)
        (root / "out" / "sft_moe_tiny" / "notes.txt").write_text("mine\n")
        argv = ("run", str(RECIPE), "--output-dir", str(root / "out"), "--resume")
        return argv, 2, ["files no run wrote"], root / "out", False

    def run_overwrite_user_metrics(root):
        (root / "out" / "sft_moe_tiny").mkdir(parents=True)
        (root / "out" / "sft_moe_tiny" / "metrics.jsonl").write_text('{"mine": 1}\n')
        argv = ("run", str(RECIPE), "--output-dir", str(root / "out"), "--overwrite")
        return argv, 2, ["no mark of a run"], root / "out", False

    def redundant_4000(root):
        run = _run_dir(root / "run")
        argv = (*place, str(run), "--ep-size", "2", "--redundant-experts", "4000")
        return argv, 2, ["is above the limit of 16"], run, True

    def sweep_max_1e9(root):
        run = _run_dir(root / "run")
        argv = (*place, str(run), "--ep-size", "2", "--sweep", "--sweep-max", "1000000000")
        return argv, 2, ["is above the limit of 16"], run, True

    def dump_expand_small(root):
        dump = _dump(root / "d.pt", "torch.ones(1, 1, 1, dtype=torch.int32).expand(100000, 2, 8)")
        argv = ("ingest", "sglang", str(dump), "--step", "1", "--run", str(root / "run"))
        return argv, 2, ["repeats 4 bytes of storage"], None, True

    def dump_expand_large(root):
        expr = "torch.ones(1, 1, 1, dtype=torch.int32).expand(100000, 1024, 1024)"
        dump = _dump(root / "d.pt", expr)
        argv = ("ingest", "sglang", str(dump), "--step", "1", "--run", str(root / "run"))
        return argv, 2, ["NEMO_MOE_METRICS_MAX_CELLS"], None, True

    def store_16384_report(root):
        run = _run_dir(root / "run")
        with (run / "expert_loads.bin").open("ab") as f:
            f.write(square_zero_record(8, 16384))
        argv = ("report", str(run), "--out", str(root / "pictures"))
        return argv, 0, ["is above the limit of 1,024"], None, True

    def store_16384_placement(root):
        run = _run_dir(root / "run")
        with (run / "expert_loads.bin").open("ab") as f:
            f.write(square_zero_record(8, 16384))
        return (*place, str(run), "--ep-size", "2"), 0, ["is above the limit of 1,024"], run, True

    def count_2_64(root):
        run = _run_dir(root / "run")
        counts = np.zeros((2, 8), np.uint64)
        counts[1, 3] = 2**64 - 1
        with (run / "expert_loads.bin").open("ab") as f:
            f.write(wide_record(8, counts, [1, 2]))
        argv = (*place, str(run), "--ep-size", "2")
        return argv, 0, ["holds a count of 18,446,744,073,709,551,615"], run, False

    def four_steps_2_62(root):
        run = _run_dir(root / "run")
        counts = np.full((2, 8), 2**62, np.uint64)
        (run / "expert_loads.bin").write_bytes(
            b"NMMELS1\n" + b"".join(wide_record(s, counts) for s in range(4))
        )
        return (*place, str(run), "--ep-size", "2"), 2, ["no stored train step"], run, False

    def dump_passes_2_62(root):
        dump = _dump(root / "d.pt", "torch.full((4, 2, 8), 2**62, dtype=torch.int64)")
        argv = ("ingest", "sglang", str(dump), "--step", "1", "--run", str(root / "run"))
        return argv, 2, ["a count is in 0..2**53-1"], None, False

    def step_above_2_64(root):
        dump = _dump(root / "d.pt", "torch.ones(1, 2, 8, dtype=torch.int32)")
        argv = ("ingest", "sglang", str(dump), "--step", str(2**64 + 1), "--run", str(root / "r"))
        return argv, 2, ["outside 0..2**53-1"], None, False

    def metrics_not_utf8(root):
        run = _run_dir(root / "run")
        with (run / "metrics.jsonl").open("ab") as f:
            f.write(b'{"step":8,"moe/layer_1/max_over_ideal":2.0,"x":"\xff"}\n')
        argv = ("report", str(run), "--out", str(root / "pictures"))
        return argv, 0, ["not UTF-8 text"], run, False

    def recipe_not_utf8(root):
        (root / "r.yaml").write_bytes(RECIPE.read_bytes() + b"# \xe9\n")
        return ("check", str(root / "r.yaml")), 2, ["is not UTF-8 text: byte 0xe9"], root, False

    def dump_text(root):
        (root / "d.pt").write_text("hello\n")
        argv = ("ingest", "sglang", str(root / "d.pt"), "--step", "1", "--run", str(root / "r"))
        return argv, 2, ["not a file torch.save writes"], root, False

    def dump_empty(root):
        (root / "d.pt").write_bytes(b"")
        argv = ("ingest", "sglang", str(root / "d.pt"), "--step", "1", "--run", str(root / "r"))
        return argv, 2, ["the file is empty (0 bytes)"], root, False

    def dump_directory(root):
        (root / "d.pt").mkdir()
        argv = ("ingest", "sglang", str(root / "d.pt"), "--step", "1", "--run", str(root / "r"))
        return argv, 2, ["is a directory"], None, False

    def store_named_by_path(root):
        (root / "run").mkdir()
        (root / "run" / "rollout_expert_loads.bin").write_text("not a store\n")
        dump = _dump(root / "d.pt", "torch.ones(1, 2, 8, dtype=torch.int32)")
        argv = ("ingest", "sglang", str(dump), "--step", "1", "--run", str(root / "run"))
        return argv, 2, [f"{root / 'run' / 'rollout_expert_loads.bin'} is not"], root / "run", False

    def name_empty(root):
        return ("check", str(RECIPE), "name="), 2, ["names no directory of its own"], None, False

    def code_pickle(root):
        code = (
            "import os, sys, torch\n"
            "class P:\n    def __reduce__(self): return (os.system, ('touch ' + sys.argv[2],))\n"
            "torch.save({'logical_count': P()}, sys.argv[1])\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(root / "d.pt"), str(root / "ran")], check=True
        )
        argv = ("ingest", "sglang", str(root / "d.pt"), "--step", "1", "--run", str(root / "r"))
        return argv, 2, ["asks for the global posix.system"], root, False

    def ep_size_16(root):
        run = _run_dir(root / "run")
        return (
            (*place, str(run), "--ep-size", "16"),
            2,
            ["pass a divisor of 8: 1, 2, 4, 8"],
            run,
            False,
        )

    def negative_step(root):
        run = _run_dir(root / "run")
        with (run / "metrics.jsonl").open("a") as f:
            f.write('{"step": -5}\n')
        argv = ("report", str(run), "--out", str(root / "pictures"))
        return argv, 0, ["step -5 is outside"], run, False

    def duplicate_keys(root):
        (root / "r.yaml").write_text(RECIPE.read_text() + "\nname: other\n")
        return ("check", str(root / "r.yaml")), 2, ["appears twice in one mapping"], root, False

    return {
        "1 --out an existing file": out_exists,
        "1 --out a link, --force": out_link,
        "1 --out beside a user's siblings": out_siblings,
        "1 --out RUN/metrics.jsonl --force": out_run_file,
        "1 --out a directory": out_directory,
        "2 ingest into a user's directory": ingest_user_dir,
        "2 run --resume into a user's directory": run_resume_user_dir,
        "2 run --overwrite of a user's metrics.jsonl": run_overwrite_user_metrics,
        "3 --redundant-experts 4000": redundant_4000,
        "3 --sweep-max 1e9": sweep_max_1e9,
        "3 a 1.7 KB expand()ed dump": dump_expand_small,
        "3 a dump declaring 80 GB": dump_expand_large,
        "3 a 16384 x 16384 record: report": store_16384_report,
        "3 a 16384 x 16384 record: placement": store_16384_placement,
        "4 a count of 2**64-1": count_2_64,
        "4 four steps of 2**62": four_steps_2_62,
        "4 dump passes of 2**62": dump_passes_2_62,
        "4 --step above 2**64": step_above_2_64,
        "5 a non-UTF-8 byte in metrics.jsonl": metrics_not_utf8,
        "5 a non-UTF-8 recipe": recipe_not_utf8,
        "5 a text file as a dump": dump_text,
        "5 an empty dump": dump_empty,
        "5 a directory as a dump": dump_directory,
        "5 a store named by its path": store_named_by_path,
        "5 name= empty": name_empty,
        "5 a code-carrying dump": code_pickle,
        "5 --ep-size 16 on 8 experts": ep_size_16,
        "7 a line of step -5": negative_step,
        "7 a key twice in a recipe": duplicate_keys,
    }


def check_hostile_inputs(root: Path) -> dict[str, dict]:
    """Run every case under ``root``; per case: ``ok``, ``peak_mb`` (bounded cases), the
    exit status and the command's last line."""
    results = {}
    for name, build in _cases().items():
        where = root / f"case{len(results):02d}"
        where.mkdir(parents=True)
        argv, status, words, kept, bounded = build(where)
        before = fingerprint(kept) if kept is not None else None
        peak, rc, said = cli_peak_mb(*argv)
        lines = [x for x in said.splitlines() if x.strip() and not x.startswith("PEAK_KB")]
        errors = [x for x in lines if x.startswith("error:")]
        ok = rc == status and "Traceback" not in said and all(w in said for w in words)
        ok = ok and (status == 0 or len(errors) == 1)
        ok = ok and (before is None or fingerprint(kept) == before)
        ok = ok and not (where / "ran").exists() and (not bounded or peak < PEAK_LIMIT_MB)
        results[name] = {
            "ok": ok,
            "exit_status": rc,
            "peak_mb": round(peak, 1) if bounded else None,
            "said": (errors or lines or [""])[-1][:300],
        }
    return results


def check_disk_full_at_end(steps: int = 3) -> dict | None:
    """Train the tiny recipe on a small tmpfs and fill it after the last step: the run must
    say that no rank failed and name the files (None without root)."""
    from benchmarks.fault_injection import fill_disk, small_filesystem

    with small_filesystem(256) as out:
        if out is None:
            return None
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"}
        cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(RECIPE)]
        cmd += [
            f"training.max_steps={steps}",
            "logger.wandb_enabled=false",
            "--output-dir",
            str(out),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        metrics = out / "sft_moe_tiny" / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= steps:
                break
            time.sleep(0.05)
        fill_disk(out)
        said, _ = proc.communicate(timeout=400)
        ok = proc.returncode == 1 and "no rank failed: every rank finished its steps" in said
        return {"ok": ok, "exit_status": proc.returncode, "said": said.strip()[-600:]}


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print one line each, optionally write them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--disk-full-at-end", action="store_true", help="also fill a tmpfs (root)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="nmm_hostile_"))
    try:
        results = check_hostile_inputs(root)
        if args.disk_full_at_end:
            results["5 a disk full after the last step"] = check_disk_full_at_end() or {
                "ok": True, "said": "skipped (needs root for a tmpfs)",
            }  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, r in results.items():
        peak = f" peak {r['peak_mb']:.0f} MB" if r.get("peak_mb") is not None else ""
        print(f"{'ok ' if r['ok'] else 'NOT MET'} {name:<44}{peak}  {r['said'][:110]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
