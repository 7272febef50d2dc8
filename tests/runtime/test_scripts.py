"""The runnable examples' start (runtime/scripts.py): started without torchrun a script says how
to start it; a missing extra under torchrun is one line from rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_cli_ux import clean_home_env

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- examples' start


def test_an_example_started_without_torchrun_says_how_to_start_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/integrate_hf_fsdp.py", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=ROOT, env=clean_home_env(tmp_path), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: examples/integrate_hf_fsdp.py runs one process per rank under torchrun (RANK and "
        "WORLD_SIZE are not set); start it with: torchrun --nproc-per-node 2 "
        f"examples/integrate_hf_fsdp.py --out {tmp_path / 'o'}"
    )


def test_a_missing_extra_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """torchtitan hidden from both ranks (sys.modules entry None, as if not installed)."""
    from nemo_moe_metrics.testing import free_port

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchtitan'] = None\n")
    env = {
        **clean_home_env(tmp_path),
        "PYTHONPATH": f"{hide}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", "examples/integrate_torchtitan.py", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours == [
        "error: examples/integrate_torchtitan.py needs torchtitan (torchtitan is not installed); "
        "install it with: pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 "
        "torch_checkpointing==0.1.1 einops==0.8.2 && pip install tyro==1.0.17 triton==3.7.1 (no "
        "extra: its own pins would break transformers; docs/en/torchtitan.md)"
    ], proc.stderr
    first_error = next(line for line in proc.stderr.splitlines() if "rror" in line)
    assert first_error == ours[0]  # before torchrun's own summary
    # torchrun's summary names the root cause with the same words (the rank's error file),
    # whichever rank exited first; no rank printed a traceback of its own.
    root = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and "needs torchtitan (torchtitan is not installed)" in root
    assert "MissingExtraError" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
