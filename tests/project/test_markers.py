"""CI picks tests by explicit markers (``pytestmark`` in each module, pyproject's list):
``-m "megatron or torchtitan"`` runs on both megatron-core lines (.ci/run). A module that
imports megatron-core, or this package's megatron-facing modules, must say which it is:
``megatron`` (both lines) or ``one_line`` (what it checks does not depend on the line)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MEGATRON_MODULES = (
    "megatron",
    "nemo_moe_metrics.megatron",
    "nemo_moe_metrics.integrations.megatron",
)


def _imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _module_marks(tree: ast.Module) -> set[str]:
    """The marker names in a module's ``pytestmark`` (one mark or a list of them)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "pytestmark" for t in node.targets
        ):
            return {
                n.attr
                for n in ast.walk(node.value)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == "mark"
            }
    return set()


def _uses_megatron(names: set[str]) -> bool:
    return any(n == m or n.startswith(m + ".") for n in names for m in MEGATRON_MODULES)


def test_every_module_that_imports_megatron_says_which_line_it_runs_on():
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if _uses_megatron(_imported(tree)) and not _module_marks(tree) & {"megatron", "one_line"}:
            unmarked.append(path.name)
    assert unmarked == [], "add pytestmark = pytest.mark.megatron (or one_line) to: " + ", ".join(
        unmarked
    )


def test_the_checker_sees_an_import_inside_a_function_and_a_list_of_marks():
    tree = ast.parse(
        "import pytest\npytestmark = [pytest.mark.usefixtures('x'), pytest.mark.megatron]\n"
        "def test_a():\n    from nemo_moe_metrics.megatron import compat\n"
    )
    assert _uses_megatron(_imported(tree))
    assert _module_marks(tree) == {"usefixtures", "megatron"}
    assert not _uses_megatron(_imported(ast.parse("import megatron_like\n")))


def test_every_marker_used_is_declared():
    declared = {
        line.split(":")[0]
        for line in tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"][
            "ini_options"
        ]["markers"]
    }
    used = set()
    for path in TESTS.rglob("test_*.py"):
        used |= _module_marks(ast.parse(path.read_text(encoding="utf-8")))
    assert used - {"usefixtures", "skipif", "filterwarnings", "parametrize"} <= declared
