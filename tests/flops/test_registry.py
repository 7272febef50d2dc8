"""The FLOP estimator registry (flops/registry.py): unknown and unregistered model types, configs
unwrapped (text configs, pretrained configs), missing fields named; the shipped real-model
fixtures' parameter counts against the published ones."""

from __future__ import annotations

import warnings

import pytest

from nemo_moe_metrics.flops import (
    FlopsBreakdown,
    UnknownModelTypeError,
    get_flops_estimator,
    load_fixture,
    register_flops_estimator,
    registered_model_types,
    try_get_flops_estimator,
)
from nemo_moe_metrics.flops import registry as registry_module
from tests.flops.test_core import llama_config

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


# --- registry -------------------------------------------------------------------------


def test_unknown_model_type_lists_registered_types_and_how_to_register():
    with pytest.raises(UnknownModelTypeError) as err:
        get_flops_estimator({"model_type": "no_such_model", "hidden_size": 8})
    text = str(err.value)
    assert "'no_such_model'" in text and "qwen3_moe" in text and "register_flops_estimator(" in text
    assert isinstance(err.value, ValueError)


def test_try_get_warns_and_returns_none_for_unknown_types_only():
    with pytest.warns(UserWarning, match="FLOP metrics disabled.*'no_such_model'"):
        assert try_get_flops_estimator({"model_type": "no_such_model"}) is None
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        try_get_flops_estimator(
            llama_config(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3)
        )


def test_config_without_model_type_is_unknown():
    with pytest.raises(UnknownModelTypeError, match="has no model_type"):
        get_flops_estimator({"hidden_size": 8})


def test_registering_twice_replaces_with_a_warning(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
    calls = []

    def first(config):
        calls.append("first")
        return lambda seq_lens, *, causal=True: FlopsBreakdown(1.0, {})

    def second(config):
        calls.append("second")
        return lambda seq_lens, *, causal=True: FlopsBreakdown(2.0, {})

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_flops_estimator("my_model", first)
    assert "my_model" in registered_model_types()
    with pytest.warns(UserWarning, match="replacing"):
        register_flops_estimator("my_model", second)
    assert get_flops_estimator({"model_type": "my_model"})([1]).total == 2.0
    assert calls == ["second"]


def test_text_config_is_unwrapped():
    cfg = load_fixture("qwen3.5-35b-a3b")
    wrapped = get_flops_estimator(cfg)([512]).total
    inner = get_flops_estimator({**cfg["text_config"], "model_type": "qwen3_5_moe"})([512]).total
    assert wrapped == inner


def test_multimodal_pretrained_config_uses_its_text_config():
    transformers = pytest.importorskip("transformers")
    cfg = load_fixture("qwen3.5-35b-a3b")
    text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    hf = transformers.Qwen3_5MoeConfig(text_config=text)
    assert get_flops_estimator(hf)([300]).total == get_flops_estimator(cfg)([300]).total


def test_pretrained_config_matches_its_config_json():
    transformers = pytest.importorskip("transformers")
    cfg = load_fixture("qwen3-30b-a3b")
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    assert get_flops_estimator(hf)([777]).total == get_flops_estimator(cfg)([777]).total


def test_missing_vocab_size_takes_the_class_default_and_zero_opts_out():
    cfg = llama_config()
    del cfg["vocab_size"]
    out = get_flops_estimator(cfg)([4]).by_component
    assert out["lm_head"] == 6 * 4 * H * 32000  # LlamaConfig's default vocab_size
    out = get_flops_estimator(cfg, vocab_size=0)([4]).by_component
    assert "lm_head" not in out


def test_field_set_to_null_names_it():
    cfg = llama_config(intermediate_size=None)
    with pytest.raises(ValueError, match="llama config has no 'intermediate_size'"):
        get_flops_estimator(cfg)


# --- real models: parameters implied by the estimator ------------------------------------


@pytest.mark.parametrize(
    ("name", "total_b", "active_b", "rel"),
    [
        ("qwen3-30b-a3b", 30.5, 3.3, 0.02),
        ("qwen1.5-moe-a2.7b", 14.3, 2.7, 0.02),  # model card: 14.3B total, 2.7B activated
        ("qwen2-57b-a14b", 57.4, 14.0, 0.02),  # 57B total ("57.4B" on the hub), A14B
        ("qwen3-235b-a22b", 235.0, 22.0, 0.02),
        ("deepseek-v3", 671.0, 37.0, 0.02),  # without the 14B MTP module
        ("mixtral-8x7b", 46.7, 12.9, 0.01),
        ("olmoe-1b-7b", 6.9, 1.3, 0.03),
        ("llama-3.1-8b", 8.03, 8.03, 0.01),
        ("qwen3.5-35b-a3b", 34.7, 3.4, 0.03),  # text model; the ~0.4B vision tower is not counted
    ],
)
def test_fixture_parameter_counts_match_published(name, total_b, active_b, rel):
    counts = get_flops_estimator(load_fixture(name)).parameter_counts()
    assert counts.total / 1e9 == pytest.approx(total_b, rel=rel)
    assert counts.active / 1e9 == pytest.approx(active_b, rel=rel)
