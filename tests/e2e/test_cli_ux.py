"""A new user's path through the real command (subprocesses): a message names the override that
brought a problem in, a subcommand's typo shows that subcommand's usage, and no docstring or
comment points outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]

GRPO = ROOT / "examples" / "configs" / "grpo_moe_tiny.yaml"


def clean_home_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "100"}


def cli_in_clean_home(tmp_path, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_home_env(tmp_path),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- 8. messages


def test_override_error_names_the_override_not_the_file(tmp_path):
    proc = cli_in_clean_home(tmp_path, "check", GRPO, "policy.megatron_cfg.track_moe_metric=true")
    assert proc.returncode == 2
    assert "override 'policy.megatron_cfg.track_moe_metric=true': unknown key" in proc.stderr
    assert f"invalid recipe {GRPO}" not in proc.stderr


def test_a_broken_recipe_file_is_still_reported_against_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GRPO.read_text().replace("num_generations: 4", "num_generation: 4"))
    proc = cli_in_clean_home(tmp_path, "check", recipe, "training.max_steps=2")
    assert proc.returncode == 2
    assert f"invalid recipe {recipe}:" in proc.stderr
    assert "override 'training.max_steps=2'" not in proc.stderr


def test_subcommand_typo_shows_the_subcommands_usage(tmp_path):
    proc = cli_in_clean_home(tmp_path, "run", GRPO, "--nprocs", "2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: nemo-moe-metrics run ")
    assert "unrecognized arguments: --nprocs 2 (did you mean --nproc?)" in proc.stderr


def test_no_docstring_or_comment_points_outside_the_repository():
    outside = re.compile(r"shared/|/work/|ENVIRONMENT\.md|~/\.")
    hits = [
        str(p.relative_to(ROOT))
        for folder in ("nemo_moe_metrics", "recipes", "benchmarks", "examples")
        for p in (ROOT / folder).rglob("*.py")
        if outside.search(p.read_text())
    ]
    assert not hits
