"""Which rank failed first, and how (launch/failures.py): the first rank's own error, read from
chained exceptions, printed with its log path and a status hint that works."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import clean_home_env, cli_in_clean_home

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


# --------------------------------------------------------------------------- 3. first error


def test_first_rank_failure_reads_the_last_of_chained_exceptions(tmp_path):
    from nemo_moe_metrics.launch import first_rank_failure

    log = tmp_path / "combined.log"
    log.write_text(
        "[default1]:some warning\n"
        "[default1]:[rank1]: Traceback (most recent call last):\n"
        '[default1]:[rank1]:   File "/x/nemo_moe_metrics/train.py", line 5, in main\n'
        "[default1]:[rank1]:     run()\n"
        '[default1]:[rank1]:   File "/v/lib/python3.11/site-packages/foo/bar.py", line 9, in run\n'
        "[default1]:[rank1]:     raise KeyError('a')\n"
        "[default1]:[rank1]: KeyError: 'a'\n"
        "[default1]:[rank1]: \n"
        "[default1]:[rank1]: The above exception was the direct cause of the following exception:\n"
        "[default1]:[rank1]: \n"
        "[default1]:[rank1]: Traceback (most recent call last):\n"
        '[default1]:[rank1]:   File "/x/nemo_moe_metrics/worker.py", line 7, in step\n'
        "[default1]:[rank1]:     boom()\n"
        "[default1]:[rank1]: ValueError: bad layout\n"
        "[default1]:[rank1]:   second line of the message\n"
        "[default0]:Traceback (most recent call last):\n"
        "[default0]:ValueError: later rank\n"
    )
    failure = first_rank_failure(log)
    assert failure.rank == 1
    assert failure.exception == "ValueError: bad layout\n  second line of the message"
    assert failure.frame == "/x/nemo_moe_metrics/worker.py:7 in step"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_failed_rank_prints_its_first_exception_log_path_and_a_working_status_hint(tmp_path):
    # kv_channels=15: RoPE needs an even head dim; megatron-core fails inside the first forward
    # on every rank, well after the process group and the model are up.
    out = tmp_path / "runs"
    proc = cli_in_clean_home(
        tmp_path,
        "run",
        GRPO,
        "training.max_steps=1",
        "policy.model.kv_channels=15",
        "--output-dir",
        out,
        timeout=380,
    )
    assert proc.returncode == 1
    text = proc.stdout
    assert re.search(
        r"rank \d raised RuntimeError: The size of tensor a \(15\) must match the size of "
        r"tensor b \(16\)",
        text,
    ), text
    assert "nemo_moe_metrics/algorithms/megatron_policy.py:" in text  # the frame in this library
    assert "raised in megatron/core/models/common/embeddings/rope_utils.py:" in text
    lines = text.splitlines()
    rank_log = next(line for line in lines if line.startswith("rank log: "))
    assert Path(rank_log.removeprefix("rank log: ")).is_file()
    # The exception comes before the log path, and no nemo-run boilerplate is shown.
    assert lines.index(rank_log) > next(i for i, x in enumerate(lines) if "raised Runtime" in x)
    assert "nemo experiment logs" not in text
    hint = next(line for line in lines if line.startswith("job status: "))
    assert "NEMORUN_HOME=" in hint
    status = subprocess.run(
        hint.removeprefix("job status: "),
        shell=True,
        capture_output=True,
        text=True,
        env=clean_home_env(tmp_path),
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "FAILED" in status.stdout
