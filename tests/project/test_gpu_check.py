"""benchmarks/gpu_check.py: clean exit without a GPU, and its plumbing runs on CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script runs checks")
def test_gpu_check_skips_cleanly_without_gpu(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert capsys.readouterr().out.startswith("SKIP: no CUDA GPU visible")


def test_gpu_check_dry_run_on_cpu_passes():
    proc = _run("--dry-run-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count("PASS ") == 3 and "ALL PASS" in proc.stdout
