"""What the loops share (algorithms/common.py): the worker's metrics merged into the loop's,
a key clash refused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.megatron


def test_merge_rejects_a_key_clash():
    from nemo_moe_metrics.algorithms.common import merge_step_metrics

    merged = merge_step_metrics({"train/reward": 1.0}, {"moe/x": 2.0})
    assert merged == {"train/reward": 1.0, "moe/x": 2.0}
    with pytest.raises(ValueError, match="train/loss"):
        merge_step_metrics({"train/loss": 1.0}, {"train/loss": 2.0})
