"""``run`` refuses a directory that holds no run of its own before its lock file is created:
``--resume`` into a user's directory and ``--overwrite`` of a user's ``metrics.jsonl`` leave
it byte-identical, with no ``.run.lock`` behind (through the real CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_files import REPO, fingerprint

from nemo_moe_metrics.cli import main

pytestmark = pytest.mark.one_line

RECIPE = str(REPO / "examples" / "configs" / "sft_moe_tiny.yaml")


def _user_dir(root: Path, name: str, text: str) -> Path:
    run_dir = root / "sft_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / name).write_text(text)
    return run_dir


@pytest.mark.parametrize(
    "name,text,flag,words",
    [
        ("notes.txt", "mine\n", "--resume", ["files no run wrote (notes.txt)", "drop --resume"]),
        ("metrics.jsonl", '{"mine": 1}\n', "--overwrite", ["no mark of a run", "not deleted"]),
        ("metrics.jsonl", '{"mine": 1}\n', "--resume", ["no mark of a run", "drop --resume"]),
    ],
)
def test_a_refused_run_leaves_no_lock_in_a_users_directory(
    tmp_path, capsys, name, text, flag, words
):
    run_dir = _user_dir(tmp_path / "out", name, text)
    before = fingerprint(tmp_path)
    assert main(["run", RECIPE, "--output-dir", str(tmp_path / "out"), flag]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and len(err.strip().splitlines()) == 1, err
    assert not (run_dir / ".run.lock").exists()
    assert fingerprint(tmp_path) == before
