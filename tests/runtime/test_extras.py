"""Optional dependencies (extras): what each extra installs, pins that keep an install
resolvable, and the one line that names a missing extra."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import clean_home_env
from tests.test_exports import python_in

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- 1. examples' extra


def _extra_requirements(extra: str) -> set[str]:
    """Distribution names ``pip install '.[extra]'`` asks for, nested extras expanded."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: set[str] = set()
    for req in project["optional-dependencies"][extra]:
        name = re.split(r"[<>=!~ \[]", req)[0].lower().replace("_", "-")
        if name == "nemo-moe-metrics":
            for sub in req.split("[", 1)[1].rstrip("]").split(","):
                out |= _extra_requirements(sub.strip())
        else:
            out.add(name)
    return out


@pytest.mark.parametrize(
    "example", sorted(p.name for p in (ROOT / "examples").glob("integrate_*.py"))
)
def test_the_all_extra_installs_every_import_of_both_examples(example):
    import ast
    import importlib.metadata as md

    tree = ast.parse((ROOT / "examples" / example).read_text())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0] for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }  # fmt: skip
    third_party = roots - set(sys.stdlib_module_names) - {"nemo_moe_metrics", "__future__"}
    third_party -= {p.stem for p in (ROOT / "examples").glob("*.py")}  # a sibling example
    provided = _extra_requirements("all") | {"torch", "numpy", "pydantic", "pyyaml"}
    if example == "integrate_torchtitan.py":  # its own install line: its pins clash with [all]
        from nemo_moe_metrics.runtime.extras import TORCHTITAN_INSTALL

        provided |= {
            w.split("==")[0].lower().replace("_", "-")
            for w in TORCHTITAN_INSTALL.split()
            if "==" in w
        }
    dists = md.packages_distributions()
    for module in third_party:
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert names & provided, f"{example} imports {module}, which [all] does not install"
    assert "transformers" in _extra_requirements("all")


def test_the_hf_example_without_transformers_names_the_hf_extra(tmp_path):
    code = (
        "import sys, importlib.abc, runpy\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['integrate_hf_fsdp.py', '--out', sys.argv[1]]\n"
        "runpy.run_path('examples/integrate_hf_fsdp.py', run_name='__main__')\n"
    )
    proc = python_in(tmp_path, code, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: examples/integrate_hf_fsdp.py needs the 'hf' extra (transformers is not "
        "installed); install it with: pip install 'nemo_moe_metrics[hf]'"
    )


# --------------------------------------------------------------------------- 13. pins


def test_the_launch_extra_caps_httpx2_below_what_leptonais_anyio_cap_allows():
    # leptonai 0.27.3 caps anyio<=4.9.0; httpx2 2.7+ needs anyio>=4.10 (pip backtracked through
    # every httpx2 release to find that out). The pin must hold what is installed.
    import importlib.metadata as md
    import re
    import tomllib

    from packaging.requirements import Requirement

    launch = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["launch"]
    pin = next(Requirement(r) for r in launch if r.startswith("httpx2"))
    assert "2.7.0" not in pin.specifier and "2.6.0" in pin.specifier
    assert md.version("httpx2") in pin.specifier
    anyio_cap = next(
        Requirement(r) for r in md.requires("leptonai") if re.match(r"anyio\b", r)
    ).specifier
    assert "4.10.0" not in anyio_cap and "4.9.0" in anyio_cap


GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"

HEAVY = (
    "ray",
    "nemo_run",
    "leptonai",
    "wandb",
    "matplotlib",
    "megatron",
    "tensorboard",
    "rich",
    "mlflow",
)


# --------------------------------------------------------------------------- 1. extras


@pytest.mark.one_line
def test_core_dependencies_are_the_metric_library_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~ ]", d)[0].lower() for d in project["dependencies"]}
    assert core == {"torch", "numpy", "pydantic", "pyyaml"}
    extras = project["optional-dependencies"]
    assert {"megatron", "launch", "wandb", "tensorboard", "report", "all", "test"} <= set(extras)
    assert "leptonai==0.27.3" in extras["launch"]
    assert any(d.startswith("nemo-run") for d in extras["launch"])
    assert any("[all]" in d for d in extras["test"]), "the test extra pulls everything it needs"


@pytest.mark.one_line
def test_importing_the_library_imports_no_launcher_ray_or_sink_backend():
    code = (
        "import sys, nemo_moe_metrics, nemo_moe_metrics.worker, nemo_moe_metrics.flops, "
        "nemo_moe_metrics.moe, nemo_moe_metrics.moe.collector, "
        "nemo_moe_metrics.worker.policy_metrics, nemo_moe_metrics.moe.aux_loss, "
        "nemo_moe_metrics.moe.reduction, nemo_moe_metrics.sinks, nemo_moe_metrics.cli, "
        "nemo_moe_metrics.config.preflight\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# Run the CLI with some modules made uninstallable (as in a core-only install).
_BLOCKED_CLI = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from nemo_moe_metrics.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli_without(tmp_path, blocked, *args):
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_CLI.format(blocked=set(blocked)), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_home_env(tmp_path),
        timeout=120,
    )


@pytest.mark.one_line
def test_run_without_the_launch_extra_names_it_before_launching(tmp_path):
    proc = _cli_without(tmp_path, {"nemo_run"}, "run", GRPO, "--output-dir", tmp_path / "runs")
    assert proc.returncode == 2, proc.stderr
    assert "needs the 'launch' extra (nemo_run is not installed)" in proc.stderr
    assert "pip install 'nemo_moe_metrics[launch]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.one_line
def test_report_without_matplotlib_prints_the_summary_and_names_the_report_extra(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    proc = _cli_without(tmp_path, {"matplotlib"}, "report", run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'nemo_moe_metrics[report]'" in proc.stdout
    assert "pictures skipped: drawing the report's pictures needs the 'report' extra" in proc.stdout
    assert "throughput: not logged" in proc.stdout  # the text summary is there
    assert not list(run_dir.glob("*.png"))
