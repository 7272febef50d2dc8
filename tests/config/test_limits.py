"""How large a file or an option may say a thing is (config/limits.py): a limit is raised by its
environment variable."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.sinks.store import (
    ExpertLoadStore,
    StoreError,
    read_expert_loads,
)

pytestmark = pytest.mark.one_line


def test_the_limit_is_raised_by_its_variable(tmp_path, monkeypatch):
    with ExpertLoadStore(tmp_path / "s.bin", fsync=False) as store:
        with pytest.raises(StoreError, match="above the limit of 4,096"):
            store.append(0, [0], np.zeros((1, 5000), np.int64))
        monkeypatch.setenv("NEMO_MOE_METRICS_MAX_EXPERTS", "8192")
        store.append(0, [0], np.zeros((1, 5000), np.int64))
    assert [s.counts.shape for s in read_expert_loads(tmp_path / "s.bin")] == [(1, 5000)]
