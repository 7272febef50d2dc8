"""examples/integrate_megatron.py run as a user runs it (torchrun), on CPU with 1 and 2 ranks.

Expected values come from the example's data (real token counts computed here from its padding
masks) and from the FLOP registry called on those lengths, not from the run's own numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path
from nemo_moe_metrics.testing import free_port

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrate_megatron.py"
STEPS, MICRO = 2, 2


def _example():
    spec = importlib.util.spec_from_file_location("integrate_megatron", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, nproc: int, expert_parallel: int) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", str(EXAMPLE), "--out", str(out),
        "--steps", str(STEPS), "--microbatches", str(MICRO),
        "--expert-parallel", str(expert_parallel), "--table-every", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(420)
@pytest.mark.parametrize("nproc,ep", [(1, 1), (2, 2)])
def test_megatron_example_writes_checked_metrics_and_a_report(tmp_path, nproc, ep):
    stdout = _run(tmp_path, nproc, ep)
    example = _example()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    from nemo_moe_metrics.flops import get_flops_estimator

    estimate = get_flops_estimator(example.transformer_config(ep), vocab_size=example.VOCAB)
    stored = {step: (ids, counts) for step, ids, counts in read_expert_loads(store_path(tmp_path))}
    assert sorted(stored) == list(range(STEPS))
    for step, row in enumerate(rows):
        lens = np.array(
            [
                int(n)
                for rank in range(nproc)
                for mb in example.microbatches(rank, step, MICRO)
                for n in (~mb["padding_mask"]).sum(-1)
            ]
        )
        assert row[mn.TOKENS] == lens.sum()
        assert row[mn.ESTIMATED_FLOPS] == pytest.approx(estimate(lens).total, rel=1e-12)
        layer_ids, counts = stored[step]
        assert layer_ids.tolist() == list(range(example.NUM_LAYERS))
        # megatron's routers see padding; the hook leaves it out, as the aux loss does.
        assert counts.sum(axis=1).tolist() == [lens.sum() * example.TOPK] * example.NUM_LAYERS
        per_layer = [row[f"moe/load_balancing_loss_layer_{i}"] for i in range(example.NUM_LAYERS)]
        assert row["moe/load_balancing_loss"] == pytest.approx(np.mean(per_layer))
        assert 0.9 < row["moe/load_balancing_loss"] < 2.0  # switch loss of a near-uniform router
    assert "run integrate_megatron: steps 0–1" in stdout
    assert (tmp_path / "expert_load_heatmap.png").stat().st_size > 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
