import os
import sys

import pytest

# Tests import helpers (tests/dist.py) by module name, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that touches megatron-core (imports it, builds the reference
    worker or a megatron config) with ``megatron``: CI runs ``-m megatron`` on both supported
    megatron-core lines (.ci/run).

    A module marked ``one_line`` is left out: what it checks (CLI messages, report text, config
    validation, Hugging Face models) does not depend on the megatron-core line, even where it
    uses a megatron run as its input, so CI runs it on the Python 3.11 line only. Test modules
    named after torchtitan are marked ``torchtitan``: CI runs them on both lines too.
    """
    touches: dict = {}
    for item in items:
        path = item.path
        if path not in touches:
            touches[path] = "megatron" in path.read_text(encoding="utf-8")
        if touches[path] and item.get_closest_marker("one_line") is None:
            item.add_marker(pytest.mark.megatron)
        if "torchtitan" in path.name:
            item.add_marker(pytest.mark.torchtitan)


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
