"""Every sink storage.md covers keeps every step logged before a real disk I/O error.

The disk is an ext4 file system on a loop device whose backing space runs out on demand
(``benchmarks/fault_injection.FailingDisk``): the device then fails every write of a new block
with a real I/O error. After the error the file system is unmounted (what never reached the
device is gone, as after a crash) and read again. Root only (it mounts); skipped elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import fault_injection as fi  # noqa: E402
from nemo_moe_metrics.config import LoggerConfig  # noqa: E402
from nemo_moe_metrics.sinks import SinkWriteError, build_sinks  # noqa: E402
from nemo_moe_metrics.sinks.base import SinkBase  # noqa: E402
from nemo_moe_metrics.sinks.tensorboard import logged_steps  # noqa: E402

pytestmark = pytest.mark.one_line


@pytest.fixture
def disk():
    with fi.failing_disk() as disk:
        if disk is None:
            pytest.skip("cannot mount a loop device here (needs root, losetup and mkfs.ext4)")
        yield disk


def _metrics(step: int) -> dict[str, float]:
    return {"train/loss": 1.0 / (step + 1), "train_perf/tokens": 64.0 * (step + 1)}


def test_tensorboard_jsonl_and_run_json_keep_every_step_before_an_io_error(disk):
    from nemo_moe_metrics.runtime.durable import write_text_durably

    run_dir = disk.mount / "run"
    cfg = LoggerConfig(tensorboard_enabled=True, wandb_enabled=False)
    sink = build_sinks(cfg, run_dir, run_name="io_error", config={"name": "io_error"})
    write_text_durably(run_dir / "recipe.yaml", "name: io_error\n")
    for step in range(5):
        sink.log(_metrics(step), step)
    disk.fail()
    failed_at = None
    for step in range(5, 40):
        try:
            sink.log(_metrics(step), step)
        except (SinkWriteError, OSError):
            failed_at = step
            break
    assert failed_at is not None, "the I/O error never reached the sinks"
    disk.reread()

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines[:5]] == [0, 1, 2, 3, 4]
    tb_steps = set(logged_steps(run_dir / "tensorboard", limit=10_000))
    assert set(range(5)) <= tb_steps, sorted(tb_steps)
    assert json.loads((run_dir / "run.json").read_text())["run_name"] == "io_error"
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text()) == {"name": "io_error"}


class _CopyingSink(SinkBase):
    """A sink that copies a temporary file into its run directory, as W&B does, on a full disk."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def wants_tables(self, step: int) -> bool:
        return False

    def location(self) -> str:
        return str(self.run_dir / "wandb")

    def log(self, metrics: dict, step: int) -> None:
        import errno

        raise OSError(
            errno.ENOSPC, "No space left on device", "/tmp/wandb-tmp/xyz", None,
            str(self.run_dir / "wandb" / "run-1" / "files" / "output.log"),
        )  # fmt: skip

    def close(self) -> None:
        pass


def test_a_full_disk_names_the_run_directorys_file_not_the_copy_source(tmp_path):
    from nemo_moe_metrics.sinks import MultiSink

    sink = MultiSink([_CopyingSink(tmp_path)])
    with pytest.raises(SinkWriteError) as err:
        sink.log({"train/loss": 1.0}, 0)
    assert f"cannot write {tmp_path / 'wandb' / 'run-1' / 'files' / 'output.log'}:" in str(
        err.value
    )
    assert "/tmp/wandb-tmp/xyz" not in str(err.value)
