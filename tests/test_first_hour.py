"""Issue 25, a new user's first hour (second pass): each trip-up, through the real command or the
public API. Kept fast: no training processes are launched here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"
SFT = ROOT / "examples" / "configs" / "sft_moe_tiny.yaml"


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "100"}


def _cli(tmp_path, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


def _python(tmp_path, code, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tmp_path),
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
        "from nemo_moe_metrics.worker import PolicyMetrics as P\n"
        "assert PolicyMetrics is P, 'the same class, not a copy'\n"
        "for name in nemo_moe_metrics.__all__:\n"
        "    getattr(nemo_moe_metrics, name)\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'matplotlib', 'wandb', 'nemo_run'}\n"
        "print(sorted(bare & {'torch', 'pydantic', 'numpy'}), sorted(heavy))\n"
        "print(MetricsConfig(track_moe_metrics=True).track_moe_metrics)\n"
    )
    proc = _python(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[] []", "True"]


def test_an_unknown_top_level_name_is_an_attribute_error(tmp_path):
    import nemo_moe_metrics

    with pytest.raises(AttributeError, match="has no attribute 'PolicyMetric'"):
        nemo_moe_metrics.PolicyMetric  # noqa: B018


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
    provided = _extra_requirements("all") | {"torch", "numpy", "pydantic", "pyyaml"}
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
    proc = _python(tmp_path, code, tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: examples/integrate_hf_fsdp.py needs the 'hf' extra (transformers is not "
        "installed); install it with: pip install 'nemo_moe_metrics[hf]'"
    )
