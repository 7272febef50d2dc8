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
def page_browser():
    """Headless Chromium (tests/browser.py) for the ``report --html`` page, started once per
    session when first asked for. None where none can start, so that a test of another path
    keeps its own checks; with NEMO_MOE_METRICS_REQUIRE_BROWSER=1 (CI) that fails instead."""
    from browser import REQUIRE, Browser, BrowserUnavailable

    try:
        browser = Browser()
    except BrowserUnavailable as err:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but no browser starts: {err}")
        yield None
        return
    yield browser
    browser.close()


@pytest.fixture
def browser(page_browser):
    """:func:`page_browser`, skipping the test where there is none (failing on CI)."""
    if page_browser is None:
        pytest.skip("no Chromium here (apt-get install chromium); CI installs it")
    return page_browser
