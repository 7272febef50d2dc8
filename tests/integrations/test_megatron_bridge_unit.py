"""MoEMetricsCallback's pieces that need no process group, and the runnable Bridge example.

Bridge's ``callbacks.py`` is the megatron-bridge 0.6.2 wheel's, loaded by file path
(``load_bridge_callbacks``); the example runs under torchrun on 2 CPU ranks.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_moe_metrics.testing import free_port, load_bridge_callbacks

# Lengths, vocabulary, messages and the example: the callback itself runs on both megatron-core
# lines in integrations/test_megatron_bridge.py, so CI runs these on one line (tests/conftest.py).
pytestmark = pytest.mark.one_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mb():
    load_bridge_callbacks()
    from nemo_moe_metrics.integrations import megatron_bridge

    return megatron_bridge


def test_the_callback_is_a_bridge_callback_and_shares_the_tracker_by_default(mb):
    from nemo_moe_metrics.config import MetricsConfig

    bridge = load_bridge_callbacks()
    callback = mb.MoEMetricsCallback({"track_moe_metrics": True})
    assert isinstance(callback, bridge.Callback)
    assert callback.cfg.aux_loss_tracker == "shared"
    explicit = mb.MoEMetricsCallback(MetricsConfig(track_moe_metrics=True, aux_loss_tracker="own"))
    assert explicit.cfg.aux_loss_tracker == "own"
    # Bridge's manager registers exactly the events the callback overrides.
    manager = bridge.normalize_callbacks([callback])
    events = {"on_train_start", "on_train_step_start", "on_train_step_end", "on_train_end"}
    assert {e for e in manager.events if manager.has_callbacks(e)} == events


def test_packed_lengths_come_from_cu_seqlens_and_ignore_the_minus_one_padding(mb):
    legacy = {"cu_seqlens": torch.tensor([[0, 5, 12, 20, -1, -1]]), "loss_mask": torch.ones(1, 24)}
    assert mb.batch_lengths(legacy)[mb.batch_lengths(legacy) > 0].tolist() == [5, 7, 8]
    assert int(mb.batch_lengths(legacy).sum()) == 20
    current = {"cu_seqlens_q": torch.tensor([0, 3, 10]), "cu_seqlens": torch.tensor([0, 4, 12])}
    assert mb.batch_lengths(current).tolist() == [3, 7]  # unpadded offsets win


def test_padded_lengths_are_the_tokens_with_a_loss(mb):
    loss_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    assert mb.batch_lengths({"tokens": torch.zeros(2, 4), "loss_mask": loss_mask}).tolist() == [
        3,
        1,
    ]
    assert mb.batch_lengths(None) is None  # a pipeline stage without a batch records nothing
    assert mb.batch_lengths({"tokens": torch.zeros(2, 4)}).tolist() == [4, 4]


def test_padded_vocabulary_follows_bridges_rule(mb):
    cfg = SimpleNamespace(
        vocab_size=50257,
        should_pad_vocab=True,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=2,
    )
    assert mb.padded_vocab_size(cfg) == 50432  # next multiple of 256
    cfg.should_pad_vocab = False
    assert mb.padded_vocab_size(cfg) == 50257


def test_wrapped_forward_step_keeps_its_signature_and_measures_each_batch(mb):
    callback = mb.MoEMetricsCallback({"track_throughput": True})

    class Recorder:
        def __init__(self):
            self.seen = []

        def microbatch(self, seq_lens):
            self.seen.append(seq_lens.tolist())

    callback.metrics = Recorder()
    callback._step = object()  # an open step

    def forward_step(state, data_iterator, model, return_schedule_plan=False):
        batch = next(data_iterator) if data_iterator is not None else None
        return batch, None

    wrapped = callback.wrap_forward_step(forward_step)
    assert inspect.signature(wrapped) == inspect.signature(forward_step)
    mask = torch.tensor([[1, 1, 0]])
    it = iter([{"loss_mask": mask}, None])
    callback._check_rerun = lambda: None  # no megatron state machine in this unit test
    assert wrapped("state", it, "model")[0]["loss_mask"] is mask
    assert wrapped("state", it, "model")[0] is None
    assert wrapped("state", None, "model")[0] is None  # a middle stage: no iterator at all
    assert callback.metrics.seen == [[2]]


def test_importing_without_bridge_names_what_to_install():
    code = "import nemo_moe_metrics.integrations.megatron_bridge"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "pip install megatron-bridge" in proc.stderr


@pytest.mark.timeout(300)
def test_bridge_example_runs_on_two_cpu_ranks_and_matches_megatrons_report(tmp_path):
    load_bridge_callbacks()  # the example finds the cached file
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", str(ROOT / "examples" / "integrate_megatron_bridge.py"),
        "--out", str(tmp_path), "--steps", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if " megatron " in line]
    assert len(lines) == 2  # load_balancing_loss and z_loss
    for parts in lines:
        assert float(parts[2]) > 0, parts  # printed to 6 decimals: equal within rounding
        assert float(parts[5]) == pytest.approx(float(parts[2]), rel=1e-6, abs=2e-6), parts
    from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

    assert [s for s, _, _ in read_expert_loads(store_path(tmp_path))] == [1, 2]
    # The callback writes what `report` needs, with no logger setting a Bridge user never sees.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("moe/max_over_ideal" in r for r in rows)
    report = subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "report", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "steps 1–2 (2 logged)" in report.stdout and "expert load over step 2:" in report.stdout
