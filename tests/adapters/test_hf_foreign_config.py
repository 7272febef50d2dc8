"""``attach(model, config)`` on a transformers model with a config that is not the model's own."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_families import tiny_config, tiny_model  # noqa: E402

from nemo_moe_metrics import MetricsConfig, PolicyMetrics  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.flops.hf_fields import config_num_experts, config_topk  # noqa: E402

pytestmark = pytest.mark.one_line
ALL_ON = MetricsConfig(track_moe_metrics=True, track_throughput=True, track_flops=True)


def _step(metrics: PolicyMetrics, model) -> dict:
    with metrics.step():
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        metrics.microbatch(seq_lens=torch.tensor([12, 12]))
        model(input_ids=ids, labels=ids).loss.backward()
    return metrics.finish_step(num_microbatches=1)


def test_another_familys_config_that_agrees_is_set_aside_for_the_models_own_with_a_warning():
    model = tiny_model("qwen3_moe")
    foreign = tiny_config("mixtral")  # the same 8 experts, top-2, but another family
    assert (config_num_experts(foreign), config_topk(foreign)) == (
        config_num_experts(model.config),
        config_topk(model.config),
    )
    metrics = PolicyMetrics(ALL_ON)
    with pytest.warns(RuntimeWarning, match="the config is a mixtral config but the model is "):
        metrics.attach(model, foreign)
    logged = _step(metrics, model)
    # What is logged is what the model's own config gives.
    own = PolicyMetrics(ALL_ON)
    twin = tiny_model("qwen3_moe")
    own.attach(twin, twin.config)
    expected = _step(own, twin)
    assert logged[mn.EXPERT_LOADS] == expected[mn.EXPERT_LOADS]
    assert logged[mn.ESTIMATED_FLOPS] == expected[mn.ESTIMATED_FLOPS]


@pytest.mark.parametrize(
    "change,named",
    [({"num_experts": 16}, "experts 16 (the model: 8)"),
     ({"num_experts_per_tok": 4}, "experts per token 4 (the model: 2)")],
)  # fmt: skip
def test_a_config_that_contradicts_the_model_is_an_error(change, named):
    model = tiny_model("qwen3_moe")
    metrics = PolicyMetrics(ALL_ON)
    with pytest.raises(ValueError, match="contradicts the model") as err:
        metrics.attach(model, tiny_config("qwen3_moe", **change))
    assert named in str(err.value) and "attach(model, model.config)" in str(err.value)


def test_the_models_own_config_and_a_copy_of_it_attach_silently():
    model = tiny_model("qwen3_moe")
    for config in (model.config, model.config.to_dict()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            PolicyMetrics(MetricsConfig(track_moe_metrics=True)).attach(model, config)


def test_encoder_decoder_moe_models_are_named_unsupported_not_silently_counted_as_nothing():
    # switch_transformers and nllb_moe: docs/en/models.md and README claim decoder-only (and
    # vision-language) MoE families only; attaching one says so in its warning.
    from transformers import (
        NllbMoeConfig,
        NllbMoeForConditionalGeneration,
        SwitchTransformersConfig,
        SwitchTransformersForConditionalGeneration,
    )

    switch = SwitchTransformersConfig(
        d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
        num_experts=4, vocab_size=50, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
    )  # fmt: skip
    nllb = NllbMoeConfig(
        d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, num_experts=4, vocab_size=50,
    )  # fmt: skip
    for config, cls in (
        (switch, SwitchTransformersForConditionalGeneration),
        (nllb, NllbMoeForConditionalGeneration),
    ):
        model = cls(config)
        with pytest.warns(RuntimeWarning, match="is an encoder-decoder MoE model"):
            PolicyMetrics(MetricsConfig(track_moe_metrics=True)).attach(model, model.config)
