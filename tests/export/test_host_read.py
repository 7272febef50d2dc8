"""The export's one host read: exact values, one read for several families, finish order."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.host_reads import HostReadCounter  # noqa: E402
from nemo_moe_metrics.export.host_read import Pending, done, read_once  # noqa: E402


def test_values_arrive_exactly_with_their_shapes():
    big = torch.tensor([2**62 + 1, -5], dtype=torch.int64)
    f32 = torch.tensor([[0.1, 1e-30], [3.4e38, float("nan")]], dtype=torch.float32)
    f64 = torch.tensor(1 / 3, dtype=torch.float64)
    (got,) = read_once([Pending((big, f32, f64), lambda host: host)])
    assert got[0].dtype == np.int64 and got[0].tolist() == [2**62 + 1, -5]
    assert got[1].shape == (2, 2)
    # float32 -> float64 is exact: the same numbers .tolist() of the float32 tensor gives.
    np.testing.assert_array_equal(got[1], np.array(f32.tolist(), dtype=np.float64))
    assert got[2].shape == () and float(got[2]) == 1 / 3


def test_several_families_cost_one_host_read():
    a = torch.arange(6, dtype=torch.int64)
    b = torch.ones(3, dtype=torch.float32)
    with HostReadCounter() as counter:
        out = read_once(
            [
                Pending((a,), lambda h: int(h[0].sum())),
                done({"k": 1}),
                Pending((b, a[:2]), lambda h: (float(h[0].sum()), h[1].tolist())),
            ]
        )
    assert counter.total == 1
    assert out == [15, {"k": 1}, (3.0, [0, 1])]


def test_then_applies_host_arithmetic_to_the_finished_result():
    pending = Pending((torch.tensor([2, 3]),), lambda h: h[0].tolist()).then(sum)
    assert read_once([pending]) == [5]


def test_a_fence_that_waited_is_called_once():
    calls = []

    def fence() -> bool:
        calls.append(1)
        return True

    read_once([Pending((torch.zeros(1),), lambda h: None, fence)])
    assert calls == [1]


def test_complex_tensors_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="complex"):
        read_once([Pending((torch.zeros(1, dtype=torch.complex64),), lambda h: h)])
