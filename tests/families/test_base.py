"""Adding a metric family is one module and one registration line (nemo_moe_metrics.families).

The test copies the package, writes one new module (``families/toy.py``: the example of
docs/en/metric_families.md, a family that counts the training router forwards through a
collector subscription) and registers it in ``families/__init__.py``, then trains a tiny
transformers MoE model through ``PolicyMetrics`` with the copy in a subprocess: the toy key
appears with the count a test-side computation expects, and nothing else of the package changed.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"  # the helpers (hf_tiny)

DOCS_PAGE = ROOT / "docs" / "en" / "metric_families.md"


def _toy_module() -> str:
    """The example module of docs/en/metric_families.md, as a reader would copy it."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS_PAGE.read_text(encoding="utf-8"), re.S)
    (module,) = [b for b in blocks if "def build(context" in b]
    return module


# One training run with the copied package: two steps of three microbatches, a no-grad
# forward in between (not counted); prints the two steps' metrics and the MoE blocks.
RUN = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
import nemo_moe_metrics
from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics
from hf_tiny import VOCAB, tiny_model

model = tiny_model("qwen3_moe")
metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, log_expert_table=False))
metrics.attach(model, model.config)
g = torch.Generator().manual_seed(0)
steps = []
for _ in range(2):
    with metrics.step():
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, 6), generator=g)
            metrics.microbatch(seq_lens=torch.full((2,), 6))
            model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model(input_ids=ids)
    steps.append(metrics.finish_step(num_microbatches=3))
blocks = sum(type(m).__name__ == "Qwen3MoeSparseMoeBlock" for m in model.modules())
print(json.dumps({{"package": nemo_moe_metrics.__file__, "blocks": blocks,
                  "steps": [{{k: v for k, v in s.items() if "toy" in k}} for s in steps]}}))
"""


def _register(init: Path) -> None:
    """Add ``toy`` to the registration list (and the import that names it)."""
    text = init.read_text(encoding="utf-8")
    anchor = "    imbalance.build,\n)"
    assert anchor in text and "    throughput,\n)" in text
    text = text.replace(anchor, "    imbalance.build,\n    toy.build,\n)")
    text = text.replace("    throughput,\n)", "    throughput,\n    toy,\n)")
    init.write_text(text, encoding="utf-8")


def _changed(a: Path, b: Path, at: str = "") -> list[str]:
    """Files that differ, or exist on one side only, between two trees (caches left out)."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [f"{at}{name}" for name in cmp.left_only + cmp.right_only + cmp.diff_files]
    for sub in cmp.common_dirs:
        out += _changed(a / sub, b / sub, f"{at}{sub}/")
    return sorted(out)


def test_a_new_family_is_one_module_and_one_registration_line(tmp_path):
    copy = tmp_path / "nemo_moe_metrics"
    shutil.copytree(ROOT / "nemo_moe_metrics", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "families" / "toy.py").write_text(_toy_module(), encoding="utf-8")
    _register(copy / "families" / "__init__.py")

    assert _changed(ROOT / "nemo_moe_metrics", copy) == ["families/__init__.py", "families/toy.py"]
    before = (ROOT / "nemo_moe_metrics" / "families" / "__init__.py").read_text().splitlines()
    after = (copy / "families" / "__init__.py").read_text().splitlines()
    assert [line for line in after if line not in before] == ["    toy,", "    toy.build,"]
    assert len(after) == len(before) + 2

    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUN.format(tests=str(SUPPORT)))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).parent == copy  # the copy ran, not the checkout
    # Every MoE block's router runs once per training forward: blocks x microbatches a step,
    # the no-grad forward not counted, the count starting afresh after each export.
    expected = result["blocks"] * 3
    assert expected == 2 * 3  # tiny qwen3_moe: two MoE layers
    assert result["steps"] == [{"moe/toy_forwards": expected}] * 2
