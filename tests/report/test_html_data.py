"""What the report page carries (report/html_data.py): arrays packed and unpacked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_moe_metrics.report.html_data import packed, unpacked

pytestmark = pytest.mark.one_line


def test_packed_arrays_come_back_exactly_small_counts_and_past_32_bits():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 2**32, (5, 3, 7))
    large = small.astype(np.int64) * 4096  # beyond uint32: travels as float64, still exact
    for a in (small, large, np.zeros((0, 4), dtype=np.int64)):
        back = unpacked(packed(a))
        assert back.shape == a.shape
        np.testing.assert_array_equal(back, a)
    assert packed(small)["dtype"] == "uint32" and packed(large)["dtype"] == "float64"
