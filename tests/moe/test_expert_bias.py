"""ExpertBiasTracker on plain tensors: range and update equal numpy on the same buffers."""

import numpy as np
import pytest
import torch

from nemo_moe_metrics.export.host_read import read_once
from nemo_moe_metrics.moe.expert_bias import ExpertBiasTracker


def _export(tracker, layer_ids):
    (out,) = read_once([tracker.enqueue(layer_ids)])
    return out


@pytest.mark.parametrize("experts", [(8, 8, 8), (8, 16, 4)], ids=["uniform", "mixed"])
def test_range_and_update_equal_numpy_over_exports(experts):
    g = torch.Generator().manual_seed(0)
    bias = {layer: torch.randn(e, generator=g) for layer, e in zip((1, 3, 4), experts, strict=True)}
    tracker = ExpertBiasTracker([(k, (lambda k=k: bias[k])) for k in bias])
    before = {k: v.numpy().copy() for k, v in bias.items()}
    for step in range(3):
        for v in bias.values():
            v.add_(torch.sign(torch.randn(v.shape, generator=g)) * 0.01 * (step + 1))
        out = _export(tracker, [0, 1, 2, 3, 4])  # layers 0 and 2: MoE without a bias
        ranges = {k: float(np.ptp(v.numpy())) for k, v in bias.items()}
        updates = {k: float(np.abs(v.numpy() - before[k]).mean()) for k, v in bias.items()}
        for k in bias:
            assert out[f"moe/layer_{k}/expert_bias_range"] == pytest.approx(ranges[k], rel=1e-6)
            assert out[f"moe/layer_{k}/expert_bias_update"] == pytest.approx(updates[k], rel=1e-6)
        assert "moe/layer_0/expert_bias_range" not in out
        assert out["moe/expert_bias_range"] == pytest.approx(np.mean(list(ranges.values())))
        assert out["moe/expert_bias_update"] == pytest.approx(np.mean(list(updates.values())))
        before = {k: v.numpy().copy() for k, v in bias.items()}


def test_a_replaced_buffer_is_followed_and_layers_without_bias_give_no_keys():
    holder = {"bias": torch.zeros(4)}
    tracker = ExpertBiasTracker([(0, lambda: holder["bias"])])
    holder["bias"] = torch.tensor([0.0, 1.0, -1.0, 0.5])  # e.g. init_weights replaced it
    out = _export(tracker, [0])
    assert out["moe/layer_0/expert_bias_range"] == 2.0
    assert out["moe/layer_0/expert_bias_update"] == pytest.approx(0.625)
    assert _export(ExpertBiasTracker([(0, lambda: None)]), [0]) == {}
