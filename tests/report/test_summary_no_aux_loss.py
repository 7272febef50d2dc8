"""The report of a run whose model has no router aux loss says so, instead of asking for a flag
that is already on (llama4_text: top-1 sigmoid router, no load-balancing loss in transformers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from hf_families import tiny_model  # noqa: E402

from nemo_moe_metrics import LoggerConfig, MetricsConfig, PolicyMetrics, build_sinks  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402

pytestmark = pytest.mark.one_line
ROOT = Path(__file__).resolve().parents[2]


def _train(model, steps: int, run_dir: Path) -> list[dict]:
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    metrics.attach(model, model.config)
    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
        run_dir,
        run_name="no_aux",
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    logged = []
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        with metrics.step():
            ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
            metrics.microbatch(seq_lens=[12, 12])
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        row = metrics.finish_step(num_microbatches=1)
        sink.log(row, step)
        logged.append(row)
    sink.close()
    return logged


def test_report_of_a_model_without_aux_loss_says_the_model_has_none(tmp_path):
    model = tiny_model("llama4_text")
    # transformers' llama4 modeling defines no load-balancing loss (the independent fact).
    import transformers.models.llama4.modeling_llama4 as modeling

    assert not hasattr(modeling, "load_balancing_loss_func")
    rows = _train(model, 2, tmp_path / "run")
    assert all(r[mn.ROUTED_TOKENS] > 0 for r in rows)
    assert not [k for r in rows for k in r if "load_balancing_loss" in k or "z_loss" in k]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "report", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "aux losses: none: the model computes no router aux loss" in proc.stdout
    assert "enable MetricsConfig(track_moe_metrics=True)" not in proc.stdout
