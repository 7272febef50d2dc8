"""nemo-moe-metrics flops through the real CLI: a model directory, a missing config.json or path,
the shipped models, zero tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_cli_ux import cli_in_clean_home

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- 6. flops


def test_flops_accepts_a_model_directory_holding_config_json(tmp_path):
    model_dir = tmp_path / "Qwen3-30B-A3B"
    model_dir.mkdir()
    fixture = ROOT / "nemo_moe_metrics" / "flops" / "fixtures" / "qwen3-30b-a3b.json"
    (model_dir / "config.json").write_text(fixture.read_text())
    by_dir = cli_in_clean_home(
        tmp_path, "flops", "--config", model_dir, "--seq-lens", "128", "--json"
    )
    by_name = cli_in_clean_home(
        tmp_path, "flops", "--config", "qwen3-30b-a3b", "--seq-lens", "128", "--json"
    )
    assert by_dir.returncode == 0, by_dir.stderr
    assert json.loads(by_dir.stdout)["total"] == json.loads(by_name.stdout)["total"] > 0


def test_flops_directory_without_config_json_says_so(tmp_path):
    proc = cli_in_clean_home(tmp_path, "flops", "--config", tmp_path, "--seq-lens", "8")
    assert proc.returncode == 2
    assert "the directory has no config.json" in proc.stderr


def test_flops_missing_path_says_it_does_not_exist(tmp_path):
    proc = cli_in_clean_home(
        tmp_path, "flops", "--config", tmp_path / "nope" / "config.json", "--seq-lens", "8"
    )
    assert proc.returncode == 2
    assert "no such file or directory" in proc.stderr
    assert "neither a config.json file nor a shipped model" not in proc.stderr


def test_flops_list_prints_the_shipped_models(tmp_path):
    proc = cli_in_clean_home(tmp_path, "flops", "--list")
    assert proc.returncode == 0, proc.stderr
    shipped = sorted(p.stem for p in (ROOT / "nemo_moe_metrics/flops/fixtures").glob("*.json"))
    listed = [line.split()[0] for line in proc.stdout.splitlines()[1:]]
    assert listed == shipped


def test_flops_zero_tokens_is_an_error_that_says_so(tmp_path):
    proc = cli_in_clean_home(tmp_path, "flops", "--config", "qwen3-30b-a3b", "--seq-lens", "0")
    assert proc.returncode == 2
    assert "zero tokens in total, so there is nothing to count" in proc.stderr
    assert proc.stdout == ""
