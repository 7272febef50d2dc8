"""Every fenced shell block of README.md and docs/en runs as written, or is marked and checked.

A block runs verbatim (``bash -euo pipefail``) unless an HTML comment right before its fence,
``<!-- docs-test: ... -->``, says why it cannot run here:

- ``synopsis``: a usage line with placeholders (``RECIPE``, ``[--nproc 2]``, ``...``);
- ``needs ...``: hardware this machine lacks (a GPU Slurm cluster, a Slurm controller);
- ``long`` / ``installs``: minutes of training or a fresh environment, with ``covered by
  FILE, ...``: the tests (or ``.ci/run``) that run it, each named file existing and, together,
  naming every script and recipe of the block.

For every marked block the cheap part still runs: each option is checked against the
``--help`` of the command it is given to, ``nemo-moe-metrics run`` and
``recipes/local_torchrun.py`` lines get ``nemo-moe-metrics check`` with the same recipe,
overrides and ``--nproc`` (the layout check), and ``recipes/slurm.py`` lines get their dry run
(``--submit``, ``--wait``, ``--resume`` dropped). Cheap commands are grouped: one workspace with
one run directory for every verbatim block, one process for every Slurm dry run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "en").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- docs-test: (.*?) -->\n\Z")
COVERED_BY = re.compile(r"covered by ([^;]+)")
COVERING_FILE = re.compile(r"(?:tests/[\w/]+\.py|\.ci/run)")
SEPARATORS = {"&&", ";", "||", "|"}
# Options a recipe run and its layout check share; the rest of `run`'s options place the run.
CHECK_OPTIONS = {"--nproc"}
SUBMIT_ONLY = {"--submit", "--wait", "--resume", "--overwrite"}


@dataclass(frozen=True)
class Block:
    """One fenced shell block: where it is, its text, its marker (None: runs verbatim)."""

    page: str
    line: int
    text: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[list[str]]:
        """Simple commands, as argument lists (comments dropped, continuations joined)."""
        joined = re.sub(r"\\\n", " ", self.text)
        found = []
        for line in joined.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token in SEPARATORS:
                    if words:
                        found.append(words)
                    words = []
                else:
                    words.append(token)
        return found


def _blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(ROOT))
    blocks = []
    for match in FENCE.finditer(text):
        before = MARKER.search(text[: match.start()])
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(name, line, match.group(1), before.group(1) if before else None))
    return blocks


BLOCKS = [b for page in PAGES for b in _blocks(page)]
VERBATIM = [b for b in BLOCKS if b.marker is None]
MARKED = [b for b in BLOCKS if b.marker is not None]


def _env() -> dict[str, str]:
    """This interpreter's bin/ first (python, nemo-moe-metrics) and this checkout importable."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "COLUMNS": "100"}


def _placeholder(words: list[str]) -> bool:
    return any(w == "..." or w.startswith(("[", "<")) or w.isupper() for w in words[1:3]) or any(
        "..." in w or "[" in w for w in words
    )


def _script(words: list[str]) -> tuple[str, list[str]] | None:
    """(the command whose --help lists the options, the options given to it), or None when the
    command is not ours (pip, git, scontrol, ...)."""
    if words[0] == "nemo-moe-metrics" and len(words) > 1:
        return f"nemo-moe-metrics {words[1]}", words[2:]
    for i, word in enumerate(words):
        ours = word.endswith(".py") and (ROOT / word).is_file() and not word.startswith("tests/")
        if ours and (words[0] in ("python", "python3", "torchrun") or i == 0):
            return word, words[i + 1 :]
    return None


def _options(words: list[str]) -> set[str]:
    options = set()
    for word in words:
        word = word.strip("[]")
        for part in word.split("|"):
            if part.startswith("--") and len(part) > 2:
                options.add(part.split("=")[0])
    return options


@functools.cache
def _help(command: str) -> str:
    if command.startswith("nemo-moe-metrics "):
        argv = [sys.executable, "-m", "nemo_moe_metrics.cli", command.split()[1], "--help"]
    else:
        argv = [sys.executable, command, "--help"]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (command, proc.stderr)
    return proc.stdout


def _recipe_command(words: list[str]) -> tuple[str, list[str]] | None:
    """('run' | 'slurm', arguments) for a recipe run with a real recipe file, else None."""
    if _placeholder(words):
        return None
    if words[:2] == ["nemo-moe-metrics", "run"]:
        args = words[2:]
        kind = "run"
    elif words[0] == "python" and len(words) > 1 and words[1] == "recipes/local_torchrun.py":
        args, kind = words[2:], "run"
    elif words[0] == "python" and len(words) > 1 and words[1] == "recipes/slurm.py":
        args, kind = words[2:], "slurm"
    else:
        return None
    if not args or not (ROOT / args[0]).is_file():
        return None
    return kind, args


def _layout_check_argv(args: list[str]) -> list[str]:
    """``check`` arguments for a run's: the recipe, its overrides and ``--nproc``."""
    kept, i = [args[0]], 1
    while i < len(args):
        word = args[i]
        if word.startswith("--"):
            valued = ("--nproc", "--output-dir", "--engine", "--ray-address")
            takes_value = "=" not in word and word in valued
            if word.split("=")[0] in CHECK_OPTIONS:
                kept += args[i : i + 2] if takes_value else [word]
            i += 2 if takes_value else 1
        else:
            kept.append(word)
            i += 1
    return kept


def _dry_run_argv(args: list[str]) -> list[str]:
    return [os.path.expandvars(w) for w in args if w not in SUBMIT_ONLY]


DRY_RUN_DRIVER = """
import contextlib, io, json, runpy, sys
main = runpy.run_path("recipes/slurm.py")["main"]
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _dry_runs(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """``python recipes/slurm.py ARGV`` for each argv, in one process (nemo-run loads once).

    From the repository root: the dry run packages the git repository, so it must be one."""
    proc = subprocess.run(
        [sys.executable, "-c", DRY_RUN_DRIVER, json.dumps(argvs)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def _git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True
    ).stdout


# --- every block is runnable or marked, and the markers are honest -------------------------


def test_the_docs_have_shell_blocks_to_check():
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/en/slurm.md", "docs/en/visualisation.md"} <= pages, pages
    assert len(VERBATIM) >= 3 and len(MARKED) >= 10


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.id)
def test_a_marked_block_says_why_and_its_covering_tests_name_its_files(block):
    marker = block.marker
    covered = COVERED_BY.search(marker)
    assert marker.startswith(
        ("synopsis", "needs ", "long", "installs", "the first line is long")
    ), (
        block.id,
        marker,
    )
    if marker.startswith(("long", "installs")) or "is long" in marker:
        assert covered, f"{block.id}: a long block names the tests that run it: {marker}"
    if not covered:
        return
    files = COVERING_FILE.findall(covered.group(1))
    assert files, (block.id, marker)
    texts = {}
    for name in files:
        assert (ROOT / name).is_file(), f"{block.id}: {name} does not exist"
        texts[name] = (ROOT / name).read_text(encoding="utf-8")
    # Every script and recipe the block runs is run by one of the named tests.
    named = {
        Path(w).name
        for words in block.commands()
        for w in words
        if w.endswith((".py", ".yaml")) and (ROOT / w).is_file() and not w.startswith("tests/")
    }
    unnamed = [n for n in named if not any(n in t for t in texts.values())]
    assert not unnamed, f"{block.id}: {files} never run {unnamed}"


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.id)
def test_every_option_of_a_marked_block_exists(block):
    for words in block.commands():
        found = _script(words)
        if found is None:
            continue
        command, args = found
        help_text = _help(command)
        missing = [o for o in _options(args) if not re.search(rf"{re.escape(o)}\b", help_text)]
        assert not missing, f"{block.id}: `{' '.join(words)}`: {command} has no {missing}"


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.id)
def test_the_layout_check_of_a_marked_run_passes(block, capsys):
    from nemo_moe_metrics.cli import main

    for words in block.commands():
        found = _recipe_command(words)
        if found is None or found[0] != "run":
            continue
        argv = ["check", *_layout_check_argv(found[1])]
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, f"{block.id}: nemo-moe-metrics {' '.join(argv)}\n{out.err}"
        assert out.out.rstrip().splitlines()[-1].startswith("OK"), out.out[-300:]


# The dry run of slurm.md's first command without its global-batch override: refused.
REFUSED = [
    "examples/configs/grpo_moe_tiny.yaml",
    *("--account", "ACCOUNT", "--partition", "PARTITION", "--nodes", "2", "--gpus-per-node", "8"),
]


@pytest.fixture(scope="module")
def dry_runs():
    """{argv: (exit code, stdout, stderr, where the docs show it)} for the dry run of every
    ``recipes/slurm.py`` command of a marked block, and of :data:`REFUSED`, in one process."""
    argvs: dict[tuple[str, ...], str] = {tuple(REFUSED): "docs/en/slurm.md (refused)"}
    for block in MARKED:
        for words in block.commands():
            found = _recipe_command(words)
            if found and found[0] == "slurm":
                argvs.setdefault(tuple(_dry_run_argv(found[1])), block.id)
    before = _git_status()
    results = _dry_runs([list(a) for a in argvs])
    assert _git_status() == before, "a dry run wrote into the repository"
    return {argv: (*r, where) for (argv, where), r in zip(argvs.items(), results, strict=True)}


def test_every_slurm_command_of_a_marked_block_has_a_dry_run_that_passes(dry_runs):
    checked = {argv: r for argv, r in dry_runs.items() if list(argv) != REFUSED}
    assert len(checked) >= 3, list(checked)
    for argv, (code, out, err, where) in checked.items():
        assert code == 0, f"{where}: python recipes/slurm.py {' '.join(argv)}\n{err}"
        assert "sbatch" in out and "#SBATCH" in out, (where, out[:300])


def test_the_refusal_slurm_md_shows_is_what_the_dry_run_prints(dry_runs):
    code, _, err, _ = dry_runs[tuple(REFUSED)]
    assert code == 2
    assert all(len(line) <= 120 for line in err.splitlines()), err  # no 476-character line
    for lang in ("en", "zh"):
        text = (ROOT / "docs" / lang / "slurm.md").read_text(encoding="utf-8")
        (shown,) = [b for b in re.findall(r"```text\n(.*?)```", text, re.S) if "cannot run" in b]
        assert shown == err, (lang, err)


# --- the verbatim blocks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder like a clone's root, for commands that write (runs/, pictures): the repository's
    folders linked in, and ``run_dir``: a 5,001-step run of 8 MoE layers x 8 experts, long
    enough for every ``--steps`` window and ``--layers 3,7`` that visualisation.md shows."""
    root = tmp_path_factory.mktemp("docs_workspace")
    for name in ("examples", "recipes", "benchmarks", "nemo_moe_metrics"):
        (root / name).symlink_to(ROOT / name)
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "long_run.py"), str(root / "run_dir")]
        + ["--steps", "5001", "--layers", "8", "--experts", "8", "--table-every", "50"],
        check=True,
        env=_env(),
        capture_output=True,
        timeout=300,
    )
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", VERBATIM, ids=lambda b: b.id)
def test_an_unmarked_block_runs_verbatim(block, workspace):
    # Slurm's dry run packages the repository, so it runs from the clone (and writes nothing).
    in_repo = "recipes/slurm.py" in block.text
    before = _git_status() if in_repo else None
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=ROOT if in_repo else workspace,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{block.id}:\n{block.text}\n{proc.stderr[-3000:]}"
    if in_repo:
        assert _git_status() == before, f"{block.id} wrote into the repository"


# --- Chinese pages show the same commands under the same markers -----------------------------


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs" / "en").glob("*.md")))
def test_chinese_page_has_the_same_commands_and_markers(page):
    en, zh = (_blocks(ROOT / "docs" / lang / page) for lang in ("en", "zh"))
    assert [(b.commands(), b.marker) for b in en] == [(b.commands(), b.marker) for b in zh]
