"""A read-only run directory (given to a sink, as the transformers and Megatron-Bridge
callbacks give theirs to ``build_sinks``) is named in the error, not the temporary file an
atomic write makes beside ``run.json``."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.runtime.durable import write_text_durably
from nemo_moe_metrics.sinks import build_sinks

pytestmark = pytest.mark.one_line


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` unwritable for this process: mode 0555, and as root (whom modes do not
    stop) an unprivileged effective user until the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o555)
    root = os.geteuid() == 0
    try:
        if root:
            os.seteuid(65534)
        yield
    finally:
        if root:
            os.seteuid(0)
        directory.chmod(0o755)


def test_a_read_only_run_dir_is_named_not_a_temporary_file(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)
    build_sinks(cfg, tmp_path / "warm", run_name="r").close()  # imports done as this user
    tmp_path.chmod(0o755)  # nobody may look inside (and find the directory read-only)
    tmp_path.parent.chmod(0o755)
    ro = tmp_path / "ro"
    with _read_only(ro), pytest.raises(PermissionError) as refused:
        build_sinks(cfg, ro, run_name="r")
    assert Path(refused.value.filename).parent == ro, refused.value  # a run file, by its path
    assert not re.search(r"\.tmp|run\.json\w{4,}", str(refused.value)), refused.value
    assert os.listdir(ro) == []
    # run.json's atomic write: the file asked for and the fix, not the temporary name.
    with _read_only(ro), pytest.raises(PermissionError) as refused:
        write_text_durably(ro / "run.json", "{}")
    assert refused.value.filename == str(ro / "run.json")
    assert "make it writable or choose another directory" in str(refused.value)
    assert os.listdir(ro) == []
