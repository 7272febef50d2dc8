"""Aux losses and the whole PolicyMetrics path on tiny Hugging Face MoE models (one process).

The oracle is transformers' own ``load_balancing_loss_func`` from each family's modeling
module, called on the router logits the model itself returns (``output_router_logits=True``).
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
import torch
from hf_tiny import FAMILIES, VOCAB, K, tiny_config, tiny_model

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.hf_aux_loss import layer_load_balancing_loss
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics, model_facts

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

torch.set_num_threads(1)
WITH_AUX = [f for f in FAMILIES if f != "deepseek_v3"]
ALL_ON = MetricsConfig(
    track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True, track_flops=True
)


def _transformers_loss(family: str):
    return importlib.import_module(
        f"transformers.models.{family}.modeling_{family}"
    ).load_balancing_loss_func


def _microbatch(seed: int, batch: int = 2, seq: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", WITH_AUX)
def test_layer_loss_equals_transformers_function_on_that_layer(family):
    model = tiny_model(family)
    out = model(input_ids=_microbatch(0), output_router_logits=True)
    func = _transformers_loss(family)
    for logits in out.router_logits:
        expected = func((logits,), num_experts=8, top_k=K)
        got = layer_load_balancing_loss(logits, 8, K)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)


def test_mean_of_layer_losses_is_not_transformers_concatenated_loss():
    # Documented difference (docs/en/aux_loss.md): transformers multiplies layer-pooled means.
    model = tiny_model("qwen3_moe")
    out = model(input_ids=_microbatch(1), output_router_logits=True)
    func = _transformers_loss("qwen3_moe")
    per_layer = [float(func((lg.detach(),), num_experts=8, top_k=K)) for lg in out.router_logits]
    concatenated = float(
        func(tuple(lg.detach() for lg in out.router_logits), num_experts=8, top_k=K)
    )
    assert abs(np.mean(per_layer) - concatenated) > 1e-6


def _run_steps(family: str, steps: int = 2, microbatches: int = 2):
    """Train ``steps`` steps through PolicyMetrics; also record transformers' own view."""
    model = tiny_model(family)
    config = model.config
    metrics = PolicyMetrics(ALL_ON)
    metrics.attach(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    func = getattr(
        importlib.import_module(f"transformers.models.{family}.modeling_{family}"),
        "load_balancing_loss_func",
        None,
    )
    results = []
    for step in range(steps):
        per_layer: list[list[float]] = []
        lens = []
        with metrics.step():
            for mb in range(microbatches):
                ids = _microbatch(10 * step + mb)
                mask = torch.ones_like(ids)
                mask[1, 7:] = 0  # one padded sequence: 7 real tokens
                metrics.microbatch(seq_lens=mask.sum(-1))
                lens += mask.sum(-1).tolist()
                out = model(input_ids=ids, attention_mask=mask, labels=ids,
                            output_router_logits=True)  # fmt: skip
                out.loss.backward()
                if func is not None:
                    per_layer.append(
                        [float(func((lg,), num_experts=8, top_k=K)) for lg in out.router_logits]
                    )
            opt.step()
            opt.zero_grad()
        results.append((metrics.finish_step(num_microbatches=microbatches), per_layer, lens))
    return config, results


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_gives_the_megatron_keys_with_independent_values(family):
    from nemo_moe_metrics.flops import get_flops_estimator

    config, results = _run_steps(family)
    moe_layers = [1, 2] if family == "deepseek_v3" else [0, 1]
    for out, per_layer, lens in results:
        real_tokens = 2 * (10 + 7)  # microbatches x real tokens: padding is not counted
        for layer in moe_layers:
            assert out[mn.layer_stat_key(layer, "max_over_ideal")] >= 1.0
        table = np.array(out[mn.EXPERT_LOADS], dtype=float)
        for layer in moe_layers:
            assert table[table[:, 0] == layer, 2].sum() == real_tokens * K
        assert out[mn.ROUTED_TOKENS] == real_tokens
        # The experts still compute the padding (3 of 20 positions per microbatch).
        assert out[mn.PADDING_FRACTION] == pytest.approx(1 - real_tokens / (2 * 2 * 10))
        assert out[mn.TOKENS] == sum(lens) == 2 * (10 + 7)  # 2 microbatches
        expected_flops = get_flops_estimator(config)(np.array(lens)).total
        assert out[mn.ESTIMATED_FLOPS] == pytest.approx(expected_flops, rel=1e-12)
        if per_layer:  # the family trains with transformers' load_balancing_loss_func
            expected = np.mean(per_layer, axis=0)  # mean over microbatches, per layer
            for i, layer in enumerate(moe_layers):
                got = out[mn.aux_loss_layer_key("load_balancing_loss", layer)]
                assert got == pytest.approx(expected[i], rel=1e-5)
            assert out[mn.aux_loss_key("load_balancing_loss")] == pytest.approx(
                float(np.mean(expected)), rel=1e-5
            )
        else:
            assert not [k for k in out if "load_balancing_loss" in k]


def test_missing_microbatch_raises_naming_microbatch():
    model = tiny_model("qwen3_moe")
    metrics = PolicyMetrics(ALL_ON)
    metrics.attach(model, model.config)
    with metrics.step():
        ids = _microbatch(0)
        model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"microbatch\(\)"):
        metrics.finish_step(num_microbatches=1)


def test_model_without_known_router_warns_naming_register_router():
    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    with pytest.warns(RuntimeWarning, match="register_router"):
        metrics.attach(Opaque(), tiny_config("qwen3_moe"))


def test_wrong_config_type_names_both_accepted_types():
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    with pytest.raises(TypeError, match="TransformerConfig or its transformers PretrainedConfig"):
        metrics.attach(torch.nn.Linear(2, 2), {"num_layers": 2})


def test_warning_filter_does_not_hide_user_warnings():
    # attach() on a real HF MoE model finds its routers: no register_router warning.
    model = tiny_model("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        PolicyMetrics(MetricsConfig(track_moe_metrics=True)).attach(model, model.config)


def test_gradient_checkpointing_recompute_adds_no_second_aux_loss():
    # transformers recomputes each layer's forward in backward: the router runs twice per step.
    model = tiny_model("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True))
    metrics.attach(model, model.config)
    func = _transformers_loss("qwen3_moe")
    with metrics.step():
        ids = _microbatch(3)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        expected = [float(func((lg.detach(),), num_experts=8, top_k=K)) for lg in out.router_logits]
        out.loss.backward()
    got = metrics.finish_step(num_microbatches=1)
    for layer in (0, 1):
        key = mn.aux_loss_layer_key("load_balancing_loss", layer)
        assert got[key] == pytest.approx(expected[layer], rel=1e-5)


def test_config_json_dict_picks_the_hugging_face_adapter():
    data = tiny_config("mixtral").to_dict()
    facts = model_facts(data)
    assert (facts.num_experts, facts.num_layers, facts.aux_loss) == (8, 2, "hf")
