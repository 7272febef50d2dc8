"""Expert-bias keys for transformers routers that balance with a correction bias.

GLM-4.5 (glm4_moe), DeepSeek-V3 and MiniMax-M2 keep an ``e_score_correction_bias`` per MoE layer
(in the router, or, for minimax_m2, in the MoE block that passes it to the router). The loop
below nudges it after each optimizer step as aux-loss-free balancing does; the logged
``moe/layer_{i}/expert_bias_range`` and ``expert_bias_update`` must equal the bias the model
holds, read independently: its range at the export, and the mean absolute change since the
previous export (the first: since attach). The report then draws ``expert_bias.png``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_families import tiny_model  # noqa: E402

from nemo_moe_metrics import LoggerConfig, MetricsConfig, PolicyMetrics, build_sinks  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402

pytestmark = pytest.mark.one_line
ROOT = Path(__file__).resolve().parents[2]
WITH_BIAS = ["glm4_moe", "deepseek_v3", "minimax_m2"]


def _biases(model) -> dict[int, torch.Tensor]:
    """Each layer's bias, found by name without the library: {layer: a copy}."""
    found = {}
    for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
        if name.endswith("e_score_correction_bias"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            found[layer] = tensor.detach().double().clone()
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", WITH_BIAS)
def test_expert_bias_keys_equal_the_bias_the_model_holds(family, tmp_path):
    model = tiny_model(family)
    held = _biases(model)
    assert held, f"{family}: no e_score_correction_bias found"
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True))
    metrics.attach(model, model.config)
    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
        tmp_path / "run",
        run_name=family,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    previous = held
    for step in range(3):
        with metrics.step():
            ids = torch.randint(0, 100, (2, 12), generator=generator)
            metrics.microbatch(seq_lens=torch.tensor([12, 12]))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        # Aux-loss-free balancing: move each layer's bias towards its under-loaded experts
        # (here a random nudge of a step-dependent size: any update must be seen as it is).
        with torch.no_grad():
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith("e_score_correction_bias"):
                    tensor.add_(0.01 * (step + 1) * torch.randn(tensor.shape, generator=generator))
        logged = metrics.finish_step(num_microbatches=1)
        sink.log(logged, step)
        now = _biases(model)
        for layer, bias in now.items():
            expected_range = float(bias.max() - bias.min())
            expected_update = float((bias - previous[layer]).abs().mean())
            assert expected_update > 0
            got = logged[f"moe/layer_{layer}/expert_bias_range"]
            assert got == pytest.approx(expected_range, rel=1e-5), (step, layer)
            got = logged[f"moe/layer_{layer}/expert_bias_update"]
            assert got == pytest.approx(expected_update, rel=1e-5), (step, layer)
        assert logged[mn.EXPERT_BIAS_RANGE] == pytest.approx(
            np.mean([float(b.max() - b.min()) for b in now.values()]), rel=1e-5
        )
        previous = now
    sink.close()
    metrics.detach()
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "report", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "expert_bias.png").stat().st_size > 10_000
    assert (
        "aux losses: none logged (the routers balance with the expert bias above)" in (proc.stdout)
        or "aux losses (last step)" in proc.stdout
    )


def test_a_model_without_a_correction_bias_logs_no_bias_keys():
    model = tiny_model("qwen3_moe")
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    metrics.attach(model, model.config)
    with metrics.step():
        ids = torch.randint(0, 100, (2, 12))
        metrics.microbatch(seq_lens=torch.tensor([12, 12]))
        model(input_ids=ids, labels=ids).loss.backward()
    logged = metrics.finish_step(num_microbatches=1)
    assert not [k for k in logged if "expert_bias" in k]
