"""What the hardening tests build and measure, shared with ``benchmarks/hostile_inputs.py``
(the same cases as a script): a user's files fingerprinted (sha256), store records written
from the format in ``store_format``'s docstring (not with the store's own encoder), and the
peak memory of one CLI command in a child process of its own."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.hostile_inputs import (  # noqa: E402
    PEAK_LIMIT_MB,
    cli_peak_mb,
    fingerprint,
    record,
    square_zero_record,
    wide_record,
)

__all__ = [
    "PEAK_LIMIT_MB",
    "REPO",
    "cli_peak_mb",
    "fingerprint",
    "record",
    "square_zero_record",
    "wide_record",
]
