"""What ``run`` prints when every rank finished but the launcher then failed (a disk that
filled after the last step): that no rank failed, and which files could not be written, with
the error's name, instead of a bare "run failed (exit 1)"."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.launch.failure_report import failure_report

pytestmark = pytest.mark.one_line

# The last lines torchrun and nemo-run wrote in the run of a disk filled after the last step
# (benchmarks/hostile_inputs.py --disk-full-at-end reproduces it on a tmpfs).
_RANK_LOG_TAIL = (
    "[default0]:  return func(*args, **kwargs)\n"
    "I1207 00:03:14.307000 17948 torch/distributed/elastic/agent/server/api.py:985] Local "
    "worker group finished (WorkerState.SUCCEEDED). Waiting 300 seconds for other agents\n"
)
_LAUNCH_LOG_TAIL = (
    "[00:04:11] Exception while waiting for Job train: [Errno 28] experiment.py:873\n"
    " No space left on device\n OSError: [Errno 28] No space left on device experiment.py:874\n"
)


def test_ranks_that_all_finished_are_not_blamed_and_the_files_are_named(tmp_path):
    run_dir = tmp_path / "sft_moe_tiny"
    log = run_dir / "nemo_run" / "experiments" / "sft" / "sft_1" / "train" / "0" / "combined.log"
    log.parent.mkdir(parents=True)
    log.write_text(_RANK_LOG_TAIL)
    (run_dir / "launch.log").write_text(_LAUNCH_LOG_TAIL)
    text = failure_report(run_dir, 1)
    first, said = text.splitlines()[:2]
    assert first == "run failed (exit 1)"
    assert said.startswith("no rank failed: every rank finished its steps"), said
    assert str(log) in said and str(run_dir / "nemo_run") in said
    assert str(run_dir / "launch.log") in said
    assert said.endswith("No space left on device (ENOSPC)"), said
    assert "no Python exception" not in text
