"""nemo-moe-metrics flops: JSON from a config file, a table from a shipped model's name, an
unknown config an exit status 2 with the choices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.flops.test_core import llama_config

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


# --- CLI ------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "flops", *args],
        capture_output=True,
        text=True,
    )


def test_cli_json_from_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama_config()))
    proc = _cli("--config", str(path), "--seq-lens", "4", "9", "--no-causal", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    core = 3 * 2 * 2 * HEADS * 2 * HD * (16 + 81)
    assert data["by_component"]["attention_core"] == core
    assert data["total"] == pytest.approx(sum(data["by_component"].values()))


def test_cli_table_from_shipped_model_name():
    proc = _cli("--config", "qwen3-30b-a3b", "--seq-lens", "4096", "4096", "1024")
    assert proc.returncode == 0, proc.stderr
    assert "routed_experts" in proc.stdout and "9216 tokens" in proc.stdout


def test_cli_unknown_config_exits_2_with_choices():
    proc = _cli("--config", "no-such-model", "--seq-lens", "4")
    assert proc.returncode == 2
    assert "qwen3-30b-a3b" in proc.stderr and "Traceback" not in proc.stderr
