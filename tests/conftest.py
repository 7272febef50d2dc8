import functools
import os
import re
import sys
from pathlib import Path

import pytest

# Tests import helpers (tests/support/dist.py) by module name, in spawned ranks too.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

#: pytest-xdist (``-n 2`` in pyproject.toml) runs one group of tests per worker at a time: a
#: module is a group (its module fixtures run once), or joins a named one with
#: ``pytestmark = pytest.mark.xdist_group(NAME)``: ``shared_runs`` holds the modules that use
#: this host's Slurm daemons and Ray processes (a longer group, with every user of the runs
#: below, was slower, measured); those runs are made once for both workers (support/once.py).
#: Named groups are the long ones and start first, then modules with end-to-end runs (``slow``),
#: then the rest, in collection order. The grouping is ours (``pytest_xdist_make_scheduler``):
#: xdist's own ``--dist loadgroup`` groups nothing under pytest 9 (each test went its own way,
#: and module fixtures ran once per worker).
_GROUP_MARK = re.compile(r"pytest\.mark\.xdist_group\(\s*[\"']([^\"']+)[\"']")


@functools.cache
def _module_group(path: str) -> str:
    """The module's named group, or its own path."""
    found = _GROUP_MARK.search((Path(__file__).parent.parent / path).read_text(encoding="utf-8"))
    return found.group(1) if found else path


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module_group(nodeid.split("::")[0])

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item):
        path = item.nodeid.split("::")[0]
        return 0 if _module_group(path) != path else 1 if path in slow else 2

    items.sort(key=rank)  # stable: collection order within each rank


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
    """The README's main job, launched once per pytest run (for all xdist workers) through the
    real launcher.

    ``nemo-moe-metrics run examples/configs/grpo_moe_tiny.yaml`` (2 torchrun ranks, W&B
    offline), shortened to 3 steps; returns the run directory.
    """
    import subprocess
    from pathlib import Path

    from once import once_for_all_workers

    def make(base: Path) -> str:
        root = Path(__file__).resolve().parent.parent
        (base / "home").mkdir()
        env = {**os.environ, "HOME": str(base / "home"), "PYTHONPATH": str(root), "COLUMNS": "120"}
        recipe = root / "examples" / "configs" / "grpo_moe_tiny.yaml"
        cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(recipe)]
        cmd += ["training.max_steps=3", "--output-dir", str(base / "runs")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=400)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return str(base / "runs" / "grpo_moe_tiny")

    return Path(once_for_all_workers(tmp_path_factory, "main_job", make))


@pytest.fixture(scope="session")
def slurm():
    """munged, slurmctld and two slurmd (n1, n2) on this host (tests/support/slurm_cluster.py),
    shared by the Slurm modules of the session and stopped at its end. Without root or the Debian
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


#: The SFT run of ``sft_torchrun_run`` (tests/launch/test_train_args.py checks its arguments arrive
#: byte for byte; tests/launch/test_ray_cluster.py compares the Ray engine's SFT with it).
SFT_TORCHRUN_OVERRIDES = [
    "policy.model.moe_layer_freq=[0,1,1,1]",
    'logger.wandb_project=naïve 名前 "quoted" it\'s $HOME `x` \\back',
    "training.max_steps=2",
    "logger.tensorboard_enabled=false",
    "logger.wandb_enabled=false",
]


@pytest.fixture(scope="session")
def sft_torchrun_run(tmp_path_factory):
    """``nemo-moe-metrics run examples/configs/sft_moe_tiny.yaml`` on 2 torchrun ranks, 2 steps,
    with a list override, odd values and an output directory with a space, from an empty
    working directory; ``(process, run directory, that working directory)``. Once per pytest
    run, for all xdist workers."""
    import subprocess
    from pathlib import Path

    from once import once_for_all_workers, process_from, process_value

    def make(base: Path) -> list:
        root = Path(__file__).resolve().parent.parent
        cwd = base / "cwd"
        cwd.mkdir()
        env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "160"}
        recipe = root / "examples" / "configs" / "sft_moe_tiny.yaml"
        proc = subprocess.run(
            [sys.executable, "-m", "nemo_moe_metrics.cli", "run", str(recipe),
             *SFT_TORCHRUN_OVERRIDES, "--output-dir", str(cwd / "out dir 'é'")],
            capture_output=True, text=True, env=env, cwd=cwd, timeout=280,
        )  # fmt: skip
        return [process_value(proc), str(cwd / "out dir 'é'" / "sft_moe_tiny"), str(cwd)]

    proc, run_dir, cwd = once_for_all_workers(tmp_path_factory, "sft_torchrun", make)
    return process_from(proc), Path(run_dir), Path(cwd)


@pytest.fixture(scope="session")
def dpo_torchrun_run(tmp_path_factory):
    """``python recipes/local_torchrun.py examples/configs/dpo_moe_tiny.yaml`` on 2 ranks, 2
    steps, per-layer logging on (as docs/en/training_loops.md runs it); ``(process, run
    directory, home)``. Once per pytest run, for all xdist workers."""
    import subprocess
    from pathlib import Path

    from once import once_for_all_workers, process_from, process_value

    def make(base: Path) -> list:
        root = Path(__file__).resolve().parent.parent
        (base / "home").mkdir()
        env = {**os.environ, "HOME": str(base / "home"), "PYTHONPATH": str(root), "COLUMNS": "120"}
        recipe = root / "examples" / "configs" / "dpo_moe_tiny.yaml"
        proc = subprocess.run(
            [sys.executable, "recipes/local_torchrun.py", str(recipe), "training.max_steps=2",
             "policy.megatron_cfg.moe_per_layer_logging=true", "--nproc", "2", "--output-dir",
             str(base / "runs")],
            capture_output=True, text=True, env=env, timeout=240, cwd=root,
        )  # fmt: skip
        return [process_value(proc), str(base / "runs" / "dpo_moe_tiny"), str(base / "home")]

    proc, run_dir, home = once_for_all_workers(tmp_path_factory, "dpo_torchrun", make)
    return process_from(proc), Path(run_dir), Path(home)


@pytest.fixture(scope="session")
def page_browser():
    """Headless Chromium (tests/support/browser.py) for the ``report --html`` page, started once per
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
