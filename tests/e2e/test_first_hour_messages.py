"""Messages a new user meets in the first hour, through the real CLI: each names the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]


# The CLI as a user without the 'hf' extra has it: transformers cannot be imported.
WITHOUT_TRANSFORMERS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from nemo_moe_metrics.cli import main
sys.exit(main(sys.argv[1:]))
"""


def first_hour_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    argv = (
        [sys.executable, "-c", code, *args]
        if code
        else [sys.executable, "-m", "nemo_moe_metrics.cli", *args]
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_flops_of_a_model_directory_without_transformers_names_the_hf_extra(tmp_path):
    # glm4_moe has no FLOP formula of its own: its FLOPs are read from the transformers model.
    config = {
        "model_type": "glm4_moe",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = first_hour_cli(
        "flops", "--config", str(tmp_path), "--seq-lens", "32", code=WITHOUT_TRANSFORMERS
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: model_type 'glm4_moe' has no FLOP formula; its FLOPs are read from the "
        "transformers model, but transformers is not installed: pip install 'nemo_moe_metrics[hf]'"
    )
    # With transformers the same command estimates (so the message is about the extra alone).
    pytest.importorskip("transformers")
    assert first_hour_cli("flops", "--config", str(tmp_path), "--seq-lens", "32").returncode == 0


ERROR_IN_STEP = """
import sys, torch
sys.path.insert(0, "tests/support")
from hf_families import tiny_model
from nemo_moe_metrics import MetricsConfig, PolicyMetrics
for family in sys.argv[1:]:
    model = tiny_model(family)
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, track_throughput=True))
    metrics.attach(model, model.config)
    try:
        with metrics.step():
            metrics.microbatch(seq_lens=torch.tensor([8]))
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
            raise RuntimeError("the user's own error")
    except RuntimeError as err:
        print(family, "caught:", err)
    # after each family: a module imported by an earlier family would show here too
    print(family, "megatron modules:",
          sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
"""

FAMILIES_WITHOUT_MEGATRON = ["llama4_text", "glm4_moe", "qwen3_moe"]


def test_an_error_inside_step_on_a_hf_model_does_not_import_megatron():
    # Models without a transformers aux loss (llama4_text, glm4_moe) used to clear megatron's
    # aux-loss tracker on this path: four "Transformer Engine and Apex" warnings first. One
    # process for the three families: importing the tiny-model matrix is most of its time.
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-c", ERROR_IN_STEP, *FAMILIES_WITHOUT_MEGATRON],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    for family in FAMILIES_WITHOUT_MEGATRON:
        assert f"{family} caught: the user's own error" in proc.stdout
        assert f"{family} megatron modules: []" in proc.stdout, proc.stdout
    assert "Transformer Engine" not in proc.stderr and "Apex" not in proc.stderr, proc.stderr
