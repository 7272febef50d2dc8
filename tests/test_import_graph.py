"""The package's shape, read from its source: no import cycle, no private name imported from
another module, no module over 600 lines, a docstring on every module.

The import graph counts module-level AND function-level imports (a cycle hidden behind a
function-level import is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_moe_metrics"
MAX_LINES = 600


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` lives in: itself, or its longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(package: Path) -> tuple[dict[str, set[str]], list[str]]:
    """``(edges, private imports)``: module -> the package's modules it imports anywhere in its
    source, and one line per ``from X import _name`` of another module's underscore name."""
    modules = module_files(package)
    root = package.name
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, modules) if alias.name.startswith(root) else None
                    if target and target != module:
                        edges[module].add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y
                    parts = base.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    source = ".".join(parts + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != root and not source.startswith(root + "."):
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:  # a submodule: from pkg import module
                        target = full
                    else:
                        target = _owner(source, modules)
                        name = alias.name
                        if name.startswith("_") and not name.startswith("__") and target != module:
                            private.append(f"{module} imports {name} from {target}")
                    if target and target != module:
                        edges[module].add(target)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def long_modules(package: Path, limit: int = MAX_LINES) -> list[str]:
    """``module (lines)`` for every module over ``limit`` lines."""
    out = []
    for module, path in module_files(package).items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            out.append(f"{module} ({lines})")
    return out


def modules_without_docstring(package: Path) -> list[str]:
    """Modules whose source opens with no docstring (empty ``__init__.py`` files excepted)."""
    out = []
    for module, path in module_files(package).items():
        text = path.read_text(encoding="utf-8")
        if text.strip() and ast.get_docstring(ast.parse(text)) is None:
            out.append(module)
    return out


# --- the checker itself, on a small package written here ------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "toy"


def test_the_checker_finds_a_cycle_hidden_in_a_function_and_a_private_import(tmp_path):
    toy = _write(
        tmp_path,
        {
            "toy/__init__.py": "",
            "toy/a.py": '"""a"""\nfrom toy.b import helper\n',
            "toy/b.py": '"""b"""\ndef helper():\n    from toy import a\n    return a\n',
            "toy/c.py": '"""c"""\nfrom toy.sub.d import _secret\n',
            "toy/sub/__init__.py": '"""sub"""\nfrom .d import public\n',
            "toy/sub/d.py": "def public(): ...\n_secret = 1\n",
        },
    )
    edges, private = import_graph(toy)
    assert edges["toy.a"] == {"toy.b"}
    assert edges["toy.b"] == {"toy.a"}  # the function-level import counts
    assert edges["toy.sub"] == {"toy.sub.d"}  # a relative import resolves
    assert cycles(edges) == [["toy.a", "toy.b"]]
    assert private == ["toy.c imports _secret from toy.sub.d"]
    assert modules_without_docstring(toy) == ["toy.sub.d"]  # the empty __init__ is excused
    (toy / "c.py").write_text('"""c"""\n' + "x = 1\n" * 600, encoding="utf-8")
    assert long_modules(toy) == ["toy.c (601)"]


def test_the_checker_reads_the_whole_package():
    edges, _ = import_graph(PACKAGE)
    assert "nemo_moe_metrics.config.recipe" in edges
    assert "nemo_moe_metrics.config.layer_pattern" in edges["nemo_moe_metrics.config.recipe"]
    assert len(edges) > 50


# --- the package -----------------------------------------------------------------------------


def test_no_import_cycle():
    edges, _ = import_graph(PACKAGE)
    assert cycles(edges) == []


def test_no_private_name_imported_from_another_module():
    _, private = import_graph(PACKAGE)
    assert private == []


def test_no_module_over_600_lines():
    assert long_modules(PACKAGE) == []


def test_every_module_has_a_docstring():
    assert modules_without_docstring(PACKAGE) == []
