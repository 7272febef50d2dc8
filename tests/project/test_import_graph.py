"""The package's shape, read from its source: no import cycle, no private name imported from
another module, no module over 600 lines, a docstring on every module; its rooms in one order
of layers (:data:`LAYERS`) that every import goes down, never up; a function-level import of
its own modules only where :data:`FUNCTION_LEVEL_IMPORTS` names what it waits for.

The import graph counts module-level AND function-level imports (a cycle hidden behind a
function-level import is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_moe_metrics"
README = PACKAGE.parent / "README.md"
MAX_LINES = 600

#: The package's rooms (its top-level folders and modules), lowest layer first: a module imports
#: only from its own room, its layer or the layers below (README.md's layout lists the same
#: order). One layer holds two rooms that need each other: the run directory opens the sinks,
#: the sinks name the run directory's files.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime",),  # processes, durable writes, extras
    ("config",),  # the recipe, its flags and checks
    ("export",),  # metric names, the expert table, the one host read
    ("megatron",),  # the megatron-core version adapter, CPU shims, model builder
    ("moe",),  # device-side measurement, no model-family knowledge
    ("flops",),  # FLOP formulas and the walk of a built model
    ("adapters",),  # one module per model family
    ("throughput",),  # StepMeter
    ("families",),  # the metric families behind one protocol
    ("worker",),  # PolicyMetrics, what a worker returns
    ("sinks", "run_dir"),  # where metrics go; the run directory and its owner
    ("placement",),  # expert placement from stored loads
    ("report",),  # reading a run: pictures, summary, page
    ("charts",),  # the shipped Vega specs
    ("algorithms",),  # the loops and the reference policy worker
    ("launch",),  # torchrun, Slurm and Ray launches
    ("integrations",),  # one module per framework or trainer
    ("train",),  # the per-rank entrypoint
    ("cli",),  # the command
    ("testing",),  # real gloo ranks for tests and benchmarks
)

#: The only function-level imports of the package's own modules: (importing module, imported
#: module) -> what the import waits for. Anywhere else an import sits at the top of its module,
#: where every reader and tool sees the structure.
FUNCTION_LEVEL_IMPORTS: dict[tuple[str, str], str] = {
    ("nemo_moe_metrics.cli.command", "nemo_moe_metrics.report"): (
        "the `report` subcommand: the report loads when it runs, not for --help or check"
    ),
    ("nemo_moe_metrics.cli.command", "nemo_moe_metrics.report.html"): (
        "the `report` subcommand: the page writer of --html (the html extra) loads when it runs"
    ),
    ("nemo_moe_metrics.cli.command", "nemo_moe_metrics.flops"): (
        "the `flops` subcommand: the FLOP registry loads when it runs"
    ),
    ("nemo_moe_metrics.cli.command", "nemo_moe_metrics.launch"): (
        "the `run` subcommand: the launcher (nemo-run, rich, Ray: the launch extra)"
    ),
    ("nemo_moe_metrics.flops.registry", "nemo_moe_metrics.flops.hf_modules"): (
        "torch: reading a built transformers model needs it, the formulas (`flops`, `check`) not"
    ),
    ("nemo_moe_metrics.megatron.compat.tracker", "nemo_moe_metrics.megatron.cpu_shims"): (
        "torch: the CPU shims import it, the megatron-core adapter does not"
    ),
}


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


def _targets(node: ast.AST, module: str, base: str, modules: dict[str, Path]) -> list[str]:
    """The package's modules an ``import`` node names, and one ``"private NAME"`` entry per
    underscore name it takes from another module."""
    root = next(iter(modules)).split(".")[0]
    out: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _owner(alias.name, modules) if alias.name.startswith(root) else None
            if target:
                out.append(target)
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from .x import y
            parts = base.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            source = ".".join(parts + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source != root and not source.startswith(root + "."):
            return out
        for alias in node.names:
            full = f"{source}.{alias.name}"
            if full in modules:  # a submodule: from pkg import module
                target = full
            else:
                target = _owner(source, modules)
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and target != module:
                    out.append(f"private {name} {target}")
            if target:
                out.append(target)
    return out


def _base(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def import_graph(package: Path) -> tuple[dict[str, set[str]], list[str]]:
    """``(edges, private imports)``: module -> the package's modules it imports anywhere in its
    source, and one line per ``from X import _name`` of another module's underscore name."""
    modules = module_files(package)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for target in _targets(node, module, _base(module, path), modules):
                if target.startswith("private "):
                    _, name, owner = target.split()
                    private.append(f"{module} imports {name} from {owner}")
                elif target != module:
                    edges[module].add(target)
    return edges, private


def function_level_imports(package: Path) -> set[tuple[str, str]]:
    """``(module, imported module)`` for every import of the package's own modules inside a
    function (a package's lazy ``__getattr__``, PEP 562, aside)."""
    modules = module_files(package)
    found: set[tuple[str, str]] = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if func.name == "__getattr__":
                continue
            for node in ast.walk(func):
                for target in _targets(node, module, _base(module, path), modules):
                    if not target.startswith("private ") and target != module:
                        found.add((module, target))
    return found


def room(module: str) -> str:
    """The room a module lives in: its top-level folder or module (``__init__``: the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(
    edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """One line per import that goes from a room to a room of a higher layer (the package's
    ``__init__``, its lazy front door, is above every layer)."""
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    level["__init__"] = len(layers)
    out = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            here, there = room(module), room(target)
            if here != there and level.get(there, -1) > level.get(here, -1):
                out.append(f"{module} ({here}) imports {target} ({there}), a higher layer")
    return out


def layers_line(layers: tuple[tuple[str, ...], ...] = LAYERS) -> str:
    """The order as README.md writes it: ``runtime < config < ... < sinks/run_dir < ...``."""
    return " < ".join("/".join(layer) for layer in layers)


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


def test_the_checker_finds_an_import_up_a_layer_and_a_function_level_one(tmp_path):
    toy = _write(
        tmp_path,
        {
            "toy/__init__.py": "",
            "toy/low/__init__.py": '"""low"""\n',
            "toy/low/a.py": '"""a"""\nfrom toy.high import b\n',
            "toy/high.py": '"""high"""\ndef f():\n    from toy.low import a\n    return a\n',
            "toy/mid.py": '"""mid"""\nimport toy.low.a\n',
        },
    )
    edges, _ = import_graph(toy)
    layers = (("low",), ("mid",), ("high",))
    assert upward_imports(edges, layers) == [
        "toy.low.a (low) imports toy.high (high), a higher layer"
    ]
    assert function_level_imports(toy) == {("toy.high", "toy.low.a")}
    assert room("toy") == "__init__" and room("toy.low.a") == "low"
    assert layers_line(layers) == "low < mid < high"
    assert layers_line((("a", "b"), ("c",))) == "a/b < c"


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


def test_every_room_of_the_package_is_in_exactly_one_layer():
    named = [name for layer in LAYERS for name in layer]
    assert len(named) == len(set(named)), "a room named twice"
    rooms = {room(m) for m in module_files(PACKAGE)} - {"__init__"}
    assert rooms == set(named), f"not in LAYERS: {rooms - set(named)}; gone: {set(named) - rooms}"


def test_no_import_goes_up_a_layer():
    edges, _ = import_graph(PACKAGE)
    assert upward_imports(edges) == []


def test_function_level_imports_of_the_package_only_where_the_allow_list_says_why():
    found = function_level_imports(PACKAGE)
    assert found - set(FUNCTION_LEVEL_IMPORTS) == set(), "import these at the top of the module"
    assert set(FUNCTION_LEVEL_IMPORTS) - found == set(), "gone from the code: drop from the list"


def test_readme_lists_the_layers_in_this_order():
    assert layers_line() in " ".join(README.read_text(encoding="utf-8").split())
