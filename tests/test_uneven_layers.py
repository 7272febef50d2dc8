"""A model whose MoE layers differ (4 experts top-1 next to 8 experts top-2), end to end.

The model is a user's own transformers model (its own ``PretrainedConfig`` subclass), with no
entry anywhere in this package: its experts follow transformers' experts interface
(``experts(hidden_states, top_k_index, top_k_weights)``), which is all ``attach`` needs. The
counts, balance statistics, table, expert-load store and report follow each layer's own expert
count and top-k; expected values come from the routing the test itself chose.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from nemo_moe_metrics import metric_names as mn  # noqa: E402
from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.report import render_report  # noqa: E402
from nemo_moe_metrics.sinks import build_sinks  # noqa: E402
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path  # noqa: E402
from nemo_moe_metrics.worker import PolicyMetrics  # noqa: E402

pytestmark = pytest.mark.one_line
HIDDEN, TOKENS = 16, 24
LAYERS = ((4, 1), (8, 2))  # (experts, top-k) per layer


class UnevenConfig(transformers.PretrainedConfig):
    """A user's config: the expert count field transformers families use, per model."""

    model_type = "uneven_moe_test"

    def __init__(self, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, **kw):
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kw)


class Experts(nn.Module):
    """transformers' experts interface: called with the chosen ids and their weights."""

    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.config = UnevenConfig(num_experts=experts, num_experts_per_tok=top_k)
        self.weight = nn.Parameter(torch.randn(experts, HIDDEN, HIDDEN) * 0.1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            w = self.weight[top_k_index[:, k]]
            out = out + top_k_weights[:, k, None] * torch.einsum("th,tho->to", hidden_states, w)
        return out


class Block(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = Experts(experts, top_k)

    def forward(self, x):
        weights, ids = torch.softmax(self.gate(x), -1).topk(self.top_k, -1)
        return x + self.experts(x, ids, weights)


class Layer(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.mlp = Block(experts, top_k)

    def forward(self, x):
        return self.mlp(x)


class UnevenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = UnevenConfig()
        self.layers = nn.ModuleList(Layer(e, k) for e, k in LAYERS)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _chosen(model, x):
    """The ids each layer's router picks, computed here from the same weights."""
    picks = []
    with torch.no_grad():
        for layer in model.layers:
            ids = torch.softmax(layer.mlp.gate(x), -1).topk(layer.mlp.top_k, -1).indices
            picks.append(
                np.bincount(ids.reshape(-1).numpy(), minlength=layer.mlp.gate.out_features)
            )
            x = layer(x)
    return picks


def test_layers_with_other_expert_counts_and_topk_run_through_table_store_and_report(tmp_path):
    torch.manual_seed(0)
    model = UnevenModel().train()
    metrics = PolicyMetrics(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, log_expert_table=True)
    )
    metrics.attach(model, model.config)
    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
        tmp_path,
        run_name="uneven",
    )
    expected = []
    for step in range(3):
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(step))
        expected.append(_chosen(model, x))
        with metrics.step():
            model(x).sum().backward()
        out = metrics.finish_step(num_microbatches=1)
        sink.log(out, step)
        rows = out[mn.EXPERT_LOADS]
        for layer, (experts, top_k) in enumerate(LAYERS):
            got = [r[2] for r in rows if r[0] == layer]
            assert got == expected[-1][layer].tolist()  # one row per real expert
            assert sum(got) == TOKENS * top_k
            assert out[mn.layer_stat_key(layer, "dropped_fraction")] == 0.0
            counts = expected[-1][layer]
            assert out[mn.layer_stat_key(layer, "max_over_ideal")] == pytest.approx(
                counts.max() * experts / counts.sum()
            )
        assert out[mn.DROPPED_FRACTION] == 0.0
    sink.close()

    stored = list(read_expert_loads(store_path(tmp_path)))
    assert [step for step, _, _ in stored] == [0, 1, 2]
    for step, layer_ids, counts in stored:
        assert layer_ids.tolist() == [0, 1]
        for layer, (experts, _) in enumerate(LAYERS):
            np.testing.assert_array_equal(counts[layer][:experts], expected[step][layer])
            assert not counts[layer][experts:].any()  # no expert beyond the layer's own
    summary = render_report(tmp_path)
    assert "2 MoE layers" in summary
