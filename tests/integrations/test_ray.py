"""The Ray integration (integrations/ray.py): importing it, or the Ray engine, imports no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The CLI, Ray and the driver's merge: what they check does not depend on the megatron-core
# line (the actors run the same worker the torchrun tests run on both lines).
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_package_and_the_ray_engine_imports_no_ray():
    code = (
        "import sys, nemo_moe_metrics, nemo_moe_metrics.launch.ray_driver, "
        "nemo_moe_metrics.integrations.ray; print('ray' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout.strip() == "False", proc.stderr
