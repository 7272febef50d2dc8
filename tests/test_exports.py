"""The public API at the top level (nemo_moe_metrics/__init__.py): every name imported lazily,
the same objects as their modules', an unknown name an AttributeError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import clean_home_env

ROOT = Path(__file__).resolve().parent.parent


def python_in(tmp_path, code, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_home_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- 14. exports


def test_top_level_exports_the_public_api_lazily(tmp_path):
    code = (
        "import sys\n"
        "import nemo_moe_metrics\n"
        "bare = {m.split('.')[0] for m in sys.modules}\n"
        "from nemo_moe_metrics import PolicyMetrics, MetricsConfig, LoggerConfig, build_sinks\n"
        "from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics as P\n"
        "assert PolicyMetrics is P, 'the same class, not a copy'\n"
        "for name in nemo_moe_metrics.__all__:\n"
        "    getattr(nemo_moe_metrics, name)\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'matplotlib', 'wandb', 'nemo_run'}\n"
        "print(sorted(bare & {'torch', 'pydantic', 'numpy'}), sorted(heavy))\n"
        "print(MetricsConfig(track_moe_metrics=True).track_moe_metrics)\n"
    )
    proc = python_in(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[] []", "True"]


def test_an_unknown_top_level_name_is_an_attribute_error(tmp_path):
    import nemo_moe_metrics

    with pytest.raises(AttributeError, match="has no attribute 'PolicyMetric'"):
        nemo_moe_metrics.PolicyMetric  # noqa: B018
