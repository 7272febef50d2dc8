"""Accelerator peaks (flops/peaks.py): looked up from the device name, a configured peak first."""

from __future__ import annotations

import pytest

from nemo_moe_metrics.flops import (
    peak_flops_per_second,
    resolve_peak_flops,
)

pytestmark = pytest.mark.megatron


# --- peaks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI300X", 1307.4e12),
        ("cpu", None),
        ("Intel(R) Xeon(R) Platinum", None),
    ],
)
def test_peak_from_device_name(name, peak):
    assert peak_flops_per_second(name) == peak


def test_configured_peak_overrides_table():
    assert resolve_peak_flops("NVIDIA H100 80GB HBM3", 500e12) == 500e12
    assert resolve_peak_flops("cpu", None) is None
