"""The tests mirror the package: ``tests/<path>/test_<name>.py`` for each module
``nemo_moe_metrics/<path>/<name>.py``, or a line in tests/UNMIRRORED.md saying where it is tested;
test folders only where the package has one (besides e2e/, project/, support/, fixtures/), and
at the top only the tests of the top-level modules (test_exports.py: the package's public names);
no test imports an underscore name of the package (tests go through public names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "nemo_moe_metrics"
UNMIRRORED = TESTS / "UNMIRRORED.md"
#: Test folders that mirror no package folder: end-to-end runs across many modules, checks of
#: the repository as a whole, helpers (on sys.path, see conftest.py) and data files.
OWN_FOLDERS = {"e2e", "project", "support", "fixtures"}


def package_modules() -> list[Path]:
    """Every module of the package, relative to it (``__init__`` and ``__main__`` aside)."""
    return sorted(
        p.relative_to(PACKAGE)
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )


def mirror(module: Path) -> Path:
    return TESTS / module.with_name(f"test_{module.name}")


def unmirrored() -> dict[str, list[str]]:
    """tests/UNMIRRORED.md's list: module path -> the test files its line names."""
    out = {}
    for line in UNMIRRORED.read_text(encoding="utf-8").splitlines():
        found = re.match(r"- `([\w/]+\.py)`: (.*)", line)
        if found:
            out[found[1]] = re.findall(r"tests/[\w/]+\.py", found[2])
    return out


def private_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` for each underscore name a test file imports from the package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append((node.lineno, alias.name))
    return out


def test_every_module_has_a_test_file_of_its_name_or_a_line_saying_where_it_is_tested():
    listed = unmirrored()
    missing = [
        str(m) for m in package_modules() if not mirror(m).is_file() and str(m) not in listed
    ]
    assert missing == [], f"add tests/<path>/test_<name>.py or a line in UNMIRRORED.md: {missing}"


def test_every_line_of_the_list_names_a_module_without_its_file_and_test_files_that_exist():
    modules = {str(m) for m in package_modules()}
    for module, files in unmirrored().items():
        assert module in modules, f"UNMIRRORED.md: {module} is no module of the package"
        assert not mirror(Path(module)).is_file(), f"{module} has its own test file now"
        assert files, f"UNMIRRORED.md: {module} names no test file"
        gone = [f for f in files if not (TESTS.parent / f).is_file()]
        assert gone == [], f"UNMIRRORED.md: {module} names missing files {gone}"


def test_every_test_folder_mirrors_a_package_folder_and_is_a_package():
    for folder in sorted(p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = folder.relative_to(TESTS)
        if rel.parts[0] in OWN_FOLDERS - {"e2e", "project"}:
            continue
        if rel.parts[0] not in OWN_FOLDERS:
            assert (PACKAGE / rel).is_dir(), f"tests/{rel} mirrors no folder of the package"
        # Test files share names across folders (test_megatron.py): each folder is a package.
        assert (folder / "__init__.py").is_file(), f"tests/{rel} needs an __init__.py"


def test_the_tests_at_the_top_are_those_of_the_top_level_modules():
    top = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {"exports"}
    stray = [p.name for p in TESTS.glob("test_*.py") if p.stem.removeprefix("test_") not in top]
    assert stray == [], f"move into the folder of the module they test: {stray}"


def test_no_test_imports_an_underscore_name_of_the_package():
    found = [
        f"{p.relative_to(TESTS.parent)}:{line} {name}"
        for p in sorted(TESTS.rglob("*.py"))
        for line, name in private_imports(p)
    ]
    assert found == [], "test through public names: " + ", ".join(found)


def test_the_checks_read_what_they_claim(tmp_path):
    code = tmp_path / "t.py"
    code.write_text(
        "import os\nfrom nemo_moe_metrics.x import _hidden, shown\nfrom os import _exit\n"
    )
    assert private_imports(code) == [(2, "_hidden")]
    assert mirror(Path("moe/balance.py")) == TESTS / "moe" / "test_balance.py"
    assert "moe/balance.py" in {str(m) for m in package_modules()}
