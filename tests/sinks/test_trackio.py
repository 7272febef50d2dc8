"""The trackio sink (sinks/trackio.py): beside report_to=trackio in the run directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REQUIRE = os.environ.get("CI") == "true" or os.environ.get("NEMO_MOE_METRICS_REQUIRE_TRL") == "1"

try:
    import trl  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs the 'trl' extra
    if REQUIRE:
        raise ImportError(f"TRL is required on CI (pip install -e '.[test]'): {err}") from err
    pytest.skip(f"TRL is not installed ({err}); pip install -e '.[trl]'", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_trackio_sink_and_report_to_trackio_side_by_side_in_the_run_directory(tmp_path):
    # Both read back through trackio's own API (trackio.sqlite_storage.SQLiteStorage).
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    store = tmp_path / "run" / "trackio"  # where the sink keeps it; report_to is pointed there
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env.update(PYTHONPATH=str(root), HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRACKIO_DIR=str(store))  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "support" / "trl_trackio.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert store.is_dir() and not (tmp_path / "hf_home" / "trackio").exists()
    by_step = {row["step"]: row for row in got["sink"]}
    for logged in got["history"]:
        row = by_step[logged["step"]]  # our sink: the Trainer's global_step, keys as they are
        for key in ("moe/routed_tokens", "moe/max_over_ideal", "train_perf/tokens"):
            assert row[key] == pytest.approx(logged[key])
    # transformers' trackio callback prefixes training keys with train/, as for TensorBoard.
    rows = [row for row in got["report_to"] if "train/moe/routed_tokens" in row]
    assert [row["train/moe/routed_tokens"] for row in rows] == [
        h["moe/routed_tokens"] for h in got["history"]
    ]
