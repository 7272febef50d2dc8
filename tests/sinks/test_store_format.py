"""The store's record headers are checked against the limits before anything is allocated: an
honest record declaring a 16384 x 16384 table (a few hundred KB on disk, 2 GiB decoded) is
skipped and named by ``report`` and ``placement``, each in bounded memory (measured in a
child); the writer keeps it (it is whole) and refuses to write one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hostile_files import PEAK_LIMIT_MB, cli_peak_mb, fingerprint, square_zero_record

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.sinks import build_sinks
from nemo_moe_metrics.sinks.store import (
    ExpertLoadStore,
    StoreError,
    read_expert_loads,
    store_path,
)

pytestmark = pytest.mark.one_line


@pytest.fixture(scope="module")
def huge_run(tmp_path_factory) -> Path:
    """A real run of 4 steps, then one honest record of a 16384 x 16384 table."""
    run = tmp_path_factory.mktemp("huge") / "run"
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, run, run_name="r")
    for step in range(4):
        rows = [[la, e, 10 + step + e, 0.0] for la in (1, 2) for e in range(8)]
        sink.log({"moe/expert_loads": rows, "train_perf/tokens": 8.0}, step)
    sink.close()
    with store_path(run).open("ab") as f:
        f.write(square_zero_record(4, 16384))
    assert store_path(run).stat().st_size < 2 << 20
    return run


@pytest.mark.parametrize("command", ["report", "placement"])
def test_a_record_declaring_16384_x_16384_is_skipped_in_bounded_memory(huge_run, command):
    extra = ["--out", str(huge_run.parent / "pictures")] if command == "report" else []
    extra += ["--ep-size", "2"] if command == "placement" else []
    peak, rc, said = cli_peak_mb(command, str(huge_run), *extra)
    assert rc == 0 and "Traceback" not in said, said
    assert "step 4: 16,384 MoE layers is above the limit of 1,024" in said, said
    assert "NEMO_MOE_METRICS_MAX_LAYERS" in said
    assert max(len(line) for line in said.splitlines()) < 400  # no 49 KB line
    assert peak < PEAK_LIMIT_MB, peak
    print(f"peak {peak:.0f} MB: {command} of a run with a 16384 x 16384 record")


def test_the_writer_keeps_a_record_above_the_limits_and_never_writes_one(huge_run, tmp_path):
    before = fingerprint(huge_run)
    with (
        ExpertLoadStore(store_path(huge_run), fsync=False) as store,  # opens, cuts nothing
        pytest.raises(StoreError, match="NEMO_MOE_METRICS_MAX_CELLS"),
    ):
        store.append(5, range(600), np.zeros((600, 600), np.int64))
    assert fingerprint(huge_run) == before
    skipped: list[str] = []
    steps = [s.step for s in read_expert_loads(store_path(huge_run), skipped=skipped)]
    assert steps == [0, 1, 2, 3] and "above the limit" in skipped[0], skipped
