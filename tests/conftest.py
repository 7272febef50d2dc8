import os
import sys

import pytest

# Tests import helpers (tests/dist.py) by module name, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = usefixtures("one_thread")``):
    tiny matmuls gain nothing from threads, and one avoids oversubscribing shared CPUs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def main_job_run(tmp_path_factory):
    """The README's main job, launched once per test session through the real launcher.

    ``nemo-moe-metrics run examples/configs/grpo_moe_tiny.yaml`` (2 torchrun ranks, W&B
    offline), shortened to 3 steps; returns the run directory.
    """
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    base = tmp_path_factory.mktemp("main_job")
    (base / "home").mkdir()
    env = {**os.environ, "HOME": str(base / "home"), "PYTHONPATH": str(root), "COLUMNS": "120"}
    recipe = root / "examples" / "configs" / "grpo_moe_tiny.yaml"
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(recipe)]
    cmd += ["training.max_steps=3", "--output-dir", str(base / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return base / "runs" / "grpo_moe_tiny"


@pytest.fixture(scope="session")
def slurm():
    """munged, slurmctld and two slurmd (n1, n2) on this host (tests/slurm_cluster.py), shared
    by the Slurm modules of the session and stopped at its end. Without root or the Debian
    packages it skips with the reason; NEMO_MOE_METRICS_REQUIRE_SLURM=1 (CI) fails instead."""
    import shutil
    import tempfile
    from pathlib import Path

    from slurm_cluster import LocalSlurm, SlurmUnavailable

    root = Path(tempfile.mkdtemp(prefix="nemo_moe_metrics_slurm_", dir="/tmp"))
    cluster = LocalSlurm(root, nodes=2)
    try:
        cluster.start()
    except SlurmUnavailable as err:
        shutil.rmtree(root, ignore_errors=True)
        if os.environ.get("NEMO_MOE_METRICS_REQUIRE_SLURM") == "1":
            pytest.fail(
                f"NEMO_MOE_METRICS_REQUIRE_SLURM=1 but the test Slurm cluster cannot start: {err}"
            )
        pytest.skip(f"no Slurm cluster here: {err}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)
