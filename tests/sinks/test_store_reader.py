"""The store reader inflates a record to the size its own header declares, never more.

A crafted record with valid checksums whose payload is 1 MB of compressed zeros (1 GiB
inflated) is skipped, said as what is wrong, and costs ``report`` under 200 MB more memory
than the same run without it. The record is built here from the format in the store's module
docstring, not with the store's own encoder.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.sinks import build_sinks
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.one_line

_PEAK = (
    "import resource, sys\n"
    "from nemo_moe_metrics.cli import main\n"
    "rc = main(['report', sys.argv[1], '--out', sys.argv[2]])\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)\n"
)


def _bomb_record(step: int, layers: int, experts: int, inflated: int) -> bytes:
    packer = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    payload = b"".join(packer.compress(chunk) for _ in range(inflated >> 20)) + packer.flush()
    head = struct.pack(
        "<4sQIIBBHII", b"ELR2", step, layers, experts, 1, 1, 0, len(payload), zlib.crc32(payload)
    )
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _report_peak_mb(run_dir: Path, out: Path) -> tuple[float, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(run_dir), str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"},
    )  # fmt: skip
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PEAK_KB"))
    assert line.split()[2] == "0", proc.stdout + proc.stderr
    return int(line.split()[1]) / 1024, proc.stdout + proc.stderr


def test_a_zlib_bomb_in_the_store_is_skipped_cheaply_and_named(tmp_path):
    clean = tmp_path / "clean"
    sink = build_sinks(LoggerConfig(wandb_enabled=False, table_every=1), clean, run_name="r")
    for step in range(3):
        rows = [[la, e, 10 + step + e, 1.0] for la in (1, 2) for e in range(4)]
        sink.log({"moe/expert_loads": rows, "train_perf/tokens": 8.0}, step)
    sink.close()
    bombed = tmp_path / "bombed"
    shutil.copytree(clean, bombed)
    record = _bomb_record(3, layers=2, experts=4, inflated=1 << 30)
    assert len(record) < 2 << 20  # about 1 MB on disk
    with store_path(bombed).open("ab") as f:
        f.write(record)

    skipped: list[str] = []
    assert [s.step for s in read_expert_loads(store_path(bombed), skipped=skipped)] == [0, 1, 2]
    assert "not inflating to the size its header declares" in skipped[0], skipped
    assert "step(s) 3" in skipped[0]

    base, _ = _report_peak_mb(clean, tmp_path / "p1")
    peak, said = _report_peak_mb(bombed, tmp_path / "p2")
    assert peak - base < 200, (base, peak)
    assert "MemoryError" not in said and "Traceback" not in said
