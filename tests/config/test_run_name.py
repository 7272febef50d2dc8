"""The run's name (config/run_name.py): a name that is not one safe path component is refused by
check and run, before anything is written; a portable name is taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_dir.test_record import file_tree, record_cli

pytestmark = pytest.mark.one_line  # CLI behaviour: the same on both megatron-core lines

REPO = Path(__file__).resolve().parents[2]

GRPO = REPO / "examples" / "configs" / "grpo_moe_tiny.yaml"


@pytest.mark.parametrize("name", ["..", ".", "", "/abs/dir", "a/b", "-rf", "é", "x" * 101])
def test_a_name_that_is_not_one_safe_path_component_is_refused_by_check_and_run(tmp_path, name):
    out = tmp_path / "project" / "out"
    out.mkdir(parents=True)
    (tmp_path / "project" / "README.md").write_text("the user's project\n")
    (out / "notes.txt").write_text("keep\n")
    before = file_tree(tmp_path)
    override = f"name={name}" if name else 'name=""'
    for command in ("check", "run"):
        flags = ["--output-dir", out, "--overwrite"] if command == "run" else []
        proc = record_cli(command, GRPO, override, *flags, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"override '{override}': " in proc.stderr, proc.stderr
        assert "the name is the run directory's name under --output-dir" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert file_tree(tmp_path) == before
    assert not (tmp_path / "abs").exists()


def test_a_portable_name_is_taken():
    from nemo_moe_metrics.config import load_recipe

    assert load_recipe(GRPO, ["name=grpo_moe_tiny.v2-b"]).name == "grpo_moe_tiny.v2-b"
