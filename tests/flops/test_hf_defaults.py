"""A partial config.json is costed exactly like the transformers config it loads into.

For every registered Hugging Face model type: the estimate from a config.json dict (fields
left out) equals the estimate from ``AutoConfig.for_model(model_type, **same_fields)``, once
with the defaults read from the installed transformers and once, in a process where
transformers cannot be imported, from the shipped table. The table itself is checked to equal
the installed transformers' declared defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_moe_metrics.flops import get_flops_estimator, hf_defaults, registered_model_types
from nemo_moe_metrics.flops.megatron import MEGATRON_MODEL_TYPE

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

LENGTHS = [1, 40, 5000]  # 5000 > the 4096-token default sliding windows

_ATTN = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=48,  # != hidden / heads, and != every class default
    intermediate_size=320,
    num_hidden_layers=4,
    vocab_size=1000,
    tie_word_embeddings=True,
)
_WINDOWED = dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)
_QWEN_MOE = dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=64)
_GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=3,
    full_attention_interval=2,
)

# A small config per type whose every field differs from the class default, so leaving one
# field out changes the estimate unless the default is the right one.
SMALL: dict[str, dict] = {
    "llama": dict(_ATTN),
    "mistral": dict(_ATTN, sliding_window=16),
    "qwen2": dict(_ATTN, **_WINDOWED),
    "qwen3": dict(_ATTN, **_WINDOWED),
    "qwen3_moe": dict(_ATTN, **_WINDOWED, **_QWEN_MOE, decoder_sparse_step=2, mlp_only_layers=[3]),
    # qwen2_moe slides on even layers below max_window_layers (here 0 and 2), and always has a
    # sigmoid-gated shared expert.
    "qwen2_moe": dict(
        _ATTN,
        **{**_WINDOWED, "max_window_layers": 3},
        **_QWEN_MOE,
        shared_expert_intermediate_size=96,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
    "mixtral": dict(_ATTN, sliding_window=16, num_local_experts=12, num_experts_per_tok=3),
    "olmoe": dict(_ATTN, num_experts=12, num_experts_per_tok=3),
    "gpt_oss": dict(_ATTN, sliding_window=16, num_local_experts=12, num_experts_per_tok=3),
    "deepseek_v3": dict(
        hidden_size=256,
        num_attention_heads=8,
        intermediate_size=320,
        moe_intermediate_size=64,
        n_routed_experts=12,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=96,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_hidden_layers=4,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
    "qwen3_next": dict(
        _ATTN,
        **_GDN,
        **_QWEN_MOE,
        shared_expert_intermediate_size=96,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "qwen3_5_text": dict(_ATTN, **_GDN),
    "qwen3_5_moe_text": dict(_ATTN, **_GDN, **_QWEN_MOE, shared_expert_intermediate_size=96),
}
# Multimodal wrappers: the fields live in text_config.
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _cases() -> list[tuple[str, str, dict]]:
    """(model_type, case name, fields): no fields, the small config, and each field left out."""
    cases = []
    for model_type in sorted(set(SMALL) | set(WRAPPERS)):
        small = SMALL[WRAPPERS.get(model_type, model_type)]
        variants = [("bare", {}), ("small", small)]
        variants += [(f"small-no-{k}", {f: v for f, v in small.items() if f != k}) for k in small]
        cases += [(model_type, name, fields) for name, fields in variants]
    return cases


CASES = _cases()


def _config_json(model_type: str, fields: dict) -> dict:
    if model_type in WRAPPERS:
        return {"model_type": model_type, "text_config": dict(fields)}
    return {"model_type": model_type, **fields}


def _summary(config) -> dict:
    est = get_flops_estimator(config)
    out = est(LENGTHS)
    params = est.parameter_counts()
    return {
        "total": out.total,
        "by_component": out.by_component,
        "params": [params.total, params.active, params.embedding],
    }


def _autoconfig_summary(model_type: str, fields: dict) -> dict:
    transformers = pytest.importorskip("transformers")
    if model_type in WRAPPERS:
        config = transformers.AutoConfig.for_model(model_type, text_config=dict(fields))
    else:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    return _summary(config)


_TABLE_ONLY = """
import json, sys
sys.modules["transformers"] = None  # as if transformers were not installed
from nemo_moe_metrics.flops import hf_defaults
from tests.flops.test_hf_defaults import CASES, _config_json, _summary
out = {"source": hf_defaults.defaults_source()}
for model_type, name, fields in CASES:
    out[f"{model_type}/{name}"] = _summary(_config_json(model_type, fields))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def table_only_estimates() -> dict:
    """Every case's estimate in a process where ``import transformers`` fails."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _TABLE_ONLY],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_table_covers_every_registered_hugging_face_type():
    registered = set(registered_model_types()) - {MEGATRON_MODEL_TYPE}
    assert registered == set(hf_defaults.HF_MODEL_TYPES)
    assert registered == set(hf_defaults.shipped_table()["model_types"])
    assert registered == set(SMALL) | set(WRAPPERS)


def test_shipped_table_equals_installed_transformers_defaults():
    pytest.importorskip("transformers")
    table = hf_defaults.shipped_table()
    for model_type in hf_defaults.HF_MODEL_TYPES:
        assert table["model_types"][model_type] == hf_defaults.transformers_entry(model_type), (
            f"{model_type}: regenerate with python -m nemo_moe_metrics.flops.hf_defaults --write"
        )


@pytest.mark.parametrize(
    ("model_type", "name", "fields"), CASES, ids=[f"{t}/{n}" for t, n, _ in CASES]
)
def test_config_json_costs_like_autoconfig_with_transformers_defaults(model_type, name, fields):
    expected = _autoconfig_summary(model_type, fields)
    assert hf_defaults.defaults_source() == "transformers"
    assert _summary(_config_json(model_type, fields)) == expected


@pytest.mark.parametrize(
    ("model_type", "name", "fields"), CASES, ids=[f"{t}/{n}" for t, n, _ in CASES]
)
def test_config_json_costs_like_autoconfig_with_shipped_table(
    model_type, name, fields, table_only_estimates
):
    expected = _autoconfig_summary(model_type, fields)
    assert table_only_estimates["source"] == "shipped table"
    got = table_only_estimates[f"{model_type}/{name}"]
    assert got == json.loads(json.dumps(expected))


def test_qwen3_moe_config_json_without_num_experts_is_costed_as_moe():
    # Qwen3MoeConfig's documented defaults: 128 experts, top-8, expert width 768,
    # hidden 2048, 24 layers, every layer sparse (decoder_sparse_step 1, no mlp_only_layers).
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 24}
    out = get_flops_estimator(cfg)([1]).by_component
    assert "dense_mlp" not in out
    assert out["routed_experts"] == 6 * 24 * 8 * 3 * 2048 * 768
    assert out["router"] == 6 * 24 * 2048 * 128


def test_explicit_fields_win_over_defaults_under_either_spelling():
    # qwen3_moe's attribute_map: num_experts is also spelt num_local_experts.
    a = get_flops_estimator({**SMALL["qwen3_moe"], "model_type": "qwen3_moe"})([8]).total
    spelt = {k: v for k, v in SMALL["qwen3_moe"].items() if k != "num_experts"}
    b = get_flops_estimator({**spelt, "num_local_experts": 12, "model_type": "qwen3_moe"})([8])
    assert a == b.total
