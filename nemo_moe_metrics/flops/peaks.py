"""Dense (no sparsity) bf16 peak FLOP/s of one accelerator, chosen from its device name.

Values are the vendors' published dense BF16 tensor-core peaks for the SXM/OAM parts unless
the name says otherwise. ``MetricsConfig.peak_flops_per_gpu`` overrides the table; an unknown
device (a CPU included) has no peak, so no MFU is reported rather than a made-up one.
"""

from __future__ import annotations

import re

# (pattern on the device name, dense bf16 FLOP/s). First match wins: specific names first
# (GH200 before H200, GB200 before B200, H100 PCIe before H100, H20 never matching H200).
PEAK_BF16_DENSE: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2.5e15),
    (r"\bGB300\b", 2.5e15),
    (r"\bB300\b", 2.25e15),
    (r"\bB200\b", 2.25e15),
    (r"\bGH200\b", 989e12),
    (r"\bH200\b", 989e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),
    (r"\bH800\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bA100\b", 312e12),
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bMI355X\b", 2.5e15),
    (r"\bMI325X\b", 1307.4e12),
    (r"\bMI300X\b", 1307.4e12),
    (r"\bMI250X\b", 383e12),
)


def peak_flops_per_second(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name such as ``torch.cuda.get_device_name()``.

    Returns None when the device is unknown (e.g. ``"cpu"``): report no MFU then.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a string, got {type(device_name).__name__}")
    for pattern, peak in PEAK_BF16_DENSE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def resolve_peak_flops(device_name: str, override: float | None = None) -> float | None:
    """The configured peak when given (``peak_flops_per_gpu``), else the table's value."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override)
    return peak_flops_per_second(device_name)
