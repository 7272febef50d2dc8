"""FLOP arithmetic, input validation, the registry, real-model fixtures and the peak table.

Expected values are built independently in each test (brute-force loops, Python integers,
published parameter counts), never read back from the estimator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_moe_metrics.flops import (
    FlopsBreakdown,
    UnknownModelTypeError,
    get_flops_estimator,
    load_fixture,
    peak_flops_per_second,
    register_flops_estimator,
    registered_model_types,
    resolve_peak_flops,
    try_get_flops_estimator,
)
from nemo_moe_metrics.flops import registry as registry_module
from nemo_moe_metrics.flops.core import (
    ChunkedWindow,
    CompressedWindow,
    PooledWindow,
    pairs_per_sequence,
)

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


def _llama(**extra):
    return {
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "vocab_size": V,
        **extra,
    }


def _brute_pairs(n, window=None):
    return sum(min(i + 1, window) if window else i + 1 for i in range(n))


# --- attention accounting -------------------------------------------------------------


def test_causal_core_counts_attended_pairs_per_sequence():
    lengths = [1, 7, 40]
    got = get_flops_estimator(_llama())(lengths, causal=True).by_component["attention_core"]
    pairs = sum(_brute_pairs(n) for n in lengths)
    assert got == 3 * 2 * 2 * HEADS * (HD + HD) * pairs


def test_noncausal_core_counts_full_square_per_sequence():
    lengths = [3, 9]
    got = get_flops_estimator(_llama())(lengths, causal=False).by_component["attention_core"]
    assert got == 3 * 2 * 2 * HEADS * 2 * HD * (9 + 81)


def test_sliding_window_counts_only_pairs_inside_window():
    est = get_flops_estimator(_llama(model_type="mistral", sliding_window=5))
    lengths = [3, 5, 6, 23]
    got = est(lengths).by_component["attention_core"]
    pairs = sum(_brute_pairs(n, window=5) for n in lengths)
    assert got == 3 * 2 * 2 * HEADS * 2 * HD * pairs


def _visible_keys(i: int, window) -> int:
    """Keys query i (0-based) sees, counted one by one from the rule in words."""
    if isinstance(window, ChunkedWindow):  # its own chunk, up to itself
        return sum(1 for j in range(i + 1) if j // window.size == i // window.size)
    if isinstance(window, CompressedWindow):  # entries of complete blocks up to it, top keep
        entries = sum(1 for block_end in range(window.rate, i + 2, window.rate))
        return entries if window.keep is None else min(entries, window.keep)
    if isinstance(window, PooledWindow):  # up to keep // pool complete pools, then its tail
        pools = [range(s, s + window.pool) for s in range(0, i + 1 - window.pool + 1, window.pool)]
        kept = sum(len(p) for p in pools[: window.keep // window.pool])
        tail = (i + 1) - len(pools) * window.pool  # keys after the last complete pool
        return kept + (tail if window.tail else 0)
    return min(i + 1, window)


@pytest.mark.parametrize(
    "window",
    [
        ChunkedWindow(4),
        ChunkedWindow(1),
        CompressedWindow(4),
        CompressedWindow(3, keep=2),
        PooledWindow(4, keep=8),
        PooledWindow(3, keep=6, tail=False),
        PooledWindow(1, keep=5),
        6,
    ],
)
def test_every_window_kind_counts_the_keys_each_query_sees(window):
    import torch

    lengths = np.arange(0, 30)
    causal = [sum(_visible_keys(i, window) for i in range(n)) for n in lengths]
    assert list(pairs_per_sequence(lengths, causal=True, window=window)) == causal
    # The device-side sums (throughput) use the same function on integer tensors.
    on_device = pairs_per_sequence(torch.tensor(lengths), causal=True, window=window)
    assert on_device.tolist() == causal
    full = [
        n * (n // window.rate) if isinstance(window, CompressedWindow) else n * n for n in lengths
    ]
    assert list(pairs_per_sequence(lengths, causal=False, window=window)) == full


def test_gpt_oss_windows_only_its_sliding_layers():
    cfg = load_fixture("gpt-oss-120b")
    est = get_flops_estimator(cfg)
    n = 4096
    got = est([n]).by_component["attention_core"]
    width = cfg["num_attention_heads"] * 2 * cfg["head_dim"]
    per_layer_type = {"sliding_attention": _brute_pairs(n, 128), "full_attention": n * (n + 1) // 2}
    pairs = sum(per_layer_type[t] for t in cfg["layer_types"])
    assert got == 3 * 2 * width * pairs


def test_causal_flag_changes_only_attention_core():
    est = get_flops_estimator(load_fixture("qwen3-30b-a3b"))
    causal, full = est([300, 41]), est([300, 41], causal=False)
    for key in causal.by_component:
        if key == "attention_core":
            assert causal.by_component[key] < full.by_component[key]
        else:
            assert causal.by_component[key] == full.by_component[key]


def test_packed_batch_is_sum_of_its_sequences_not_one_long_sequence():
    est = get_flops_estimator(load_fixture("llama-3.1-8b"))
    packed = est([1000, 3000]).total
    assert packed == pytest.approx(est([1000]).total + est([3000]).total, rel=1e-12)
    assert packed < est([4000]).total


def test_total_is_sum_of_components():
    out = get_flops_estimator(load_fixture("qwen3-next-80b-a3b"))([4096, 17])
    assert isinstance(out, FlopsBreakdown)
    assert out.total == pytest.approx(sum(out.by_component.values()), rel=1e-12)


def test_component_keys_follow_the_architecture():
    keys = set(get_flops_estimator(load_fixture("qwen3-next-80b-a3b"))([8]).by_component)
    assert keys == {
        "attention_projections",
        "attention_core",
        "linear_attention_projections",
        "linear_attention_conv",
        "linear_attention_core",
        "router",
        "routed_experts",
        "shared_experts",
        "lm_head",
    }
    dense = set(get_flops_estimator(load_fixture("llama-3.1-8b"))([8]).by_component)
    assert dense == {"attention_projections", "attention_core", "dense_mlp", "lm_head"}


def test_head_dim_is_read_not_derived_from_hidden():
    # Qwen3-235B: head_dim 128 while hidden/heads = 64 (a 1.84x undercount if assumed).
    cfg = load_fixture("qwen3-235b-a22b")
    got = get_flops_estimator(cfg)([1]).by_component["attention_projections"]
    h, q, kv = (
        cfg["hidden_size"],
        cfg["num_attention_heads"] * 128,
        cfg["num_key_value_heads"] * 128,
    )
    assert got == 6 * cfg["num_hidden_layers"] * (h * q + 2 * h * kv + q * h)


def test_decoder_sparse_step_and_mlp_only_layers_pick_moe_layers():
    cfg = {
        **_llama(model_type="qwen3_moe", num_hidden_layers=6),
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 10,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [5],
    }
    out = get_flops_estimator(cfg)([1]).by_component
    moe_layers = 2  # layers 1 and 3 ((i+1) % 2 == 0), layer 5 forced dense
    assert out["routed_experts"] == 6 * moe_layers * 3 * H * 10
    assert out["dense_mlp"] == 6 * (6 - moe_layers) * 3 * H * FFN


def test_deepseek_first_k_dense_and_shared_experts():
    cfg = load_fixture("deepseek-v3")
    out = get_flops_estimator(cfg)([1]).by_component
    h, w = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert out["dense_mlp"] == 6 * 3 * 3 * h * cfg["intermediate_size"]
    assert out["shared_experts"] == 6 * 58 * 3 * h * w
    assert out["routed_experts"] == 6 * 58 * 8 * 3 * h * w


# --- input validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([4, -1], ValueError, r"seq_lens\[1\] = -1 is negative"),
        ([4, 2.5], TypeError, r"seq_lens\[1\] = 2.5 is not an integer"),
        ([True], TypeError, "not an integer"),
        (np.array([1.0, 2.0]), TypeError, "dtype float64"),
        (np.ones((2, 2), dtype=np.int64), ValueError, "must be 1-D"),
        (4096, TypeError, r"pass \[4096\]"),
        ("4096", TypeError, "must be a list"),
    ],
)
def test_bad_seq_lens_raise_clear_errors(bad, error, message):
    with pytest.raises(error, match=message):
        get_flops_estimator(_llama())(bad)


def test_empty_batch_is_zero():
    out = get_flops_estimator(_llama())([])
    assert out.total == 0.0
    assert set(out.by_component.values()) == {0.0}


def test_numpy_and_torch_lengths_match_lists():
    torch = pytest.importorskip("torch")
    est = get_flops_estimator(_llama())
    expected = est([5, 9]).total
    assert est(np.array([5, 9], dtype=np.int32)).total == expected
    assert est(torch.tensor([5, 9])).total == expected


def test_million_token_sequences_do_not_overflow():
    est = get_flops_estimator(_llama())
    n = 1_000_000
    # int32 input: n * n would wrap around in the input's own dtype.
    got = est(np.full(8, n, dtype=np.int32), causal=False).by_component["attention_core"]
    exact = 3 * 2 * 2 * HEADS * 2 * HD * 8 * n * n  # 2 layers; Python ints: exact
    assert got == pytest.approx(exact, rel=1e-12)


def test_large_batch_is_vectorised():
    est = get_flops_estimator(load_fixture("gpt-oss-120b"))
    lengths = np.random.default_rng(0).integers(1, 8192, size=200_000)
    start = time.perf_counter()
    total = est(lengths).total
    elapsed = time.perf_counter() - start
    sample = est(lengths[:3]).total
    assert sample == pytest.approx(sum(est([int(n)]).total for n in lengths[:3]), rel=1e-12)
    assert total > 0 and elapsed < 1.0, elapsed


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
            _llama(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3)
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
    cfg = _llama()
    del cfg["vocab_size"]
    out = get_flops_estimator(cfg)([4]).by_component
    assert out["lm_head"] == 6 * 4 * H * 32000  # LlamaConfig's default vocab_size
    out = get_flops_estimator(cfg, vocab_size=0)([4]).by_component
    assert "lm_head" not in out


def test_field_set_to_null_names_it():
    cfg = _llama(intermediate_size=None)
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


def test_gpt_oss_parameter_counts_match_model_card():
    # Model card: 116.83B total, 5.13B active, counting the unembedding but not the embedding.
    counts = get_flops_estimator(load_fixture("gpt-oss-120b")).parameter_counts()
    assert counts.total / 1e9 == pytest.approx(116.83, rel=0.005)
    assert (counts.active - counts.embedding / 2) / 1e9 == pytest.approx(5.13, rel=0.01)


def test_qwen3_next_parameter_counts_match_published():
    counts = get_flops_estimator(load_fixture("qwen3-next-80b-a3b")).parameter_counts()
    assert counts.total / 1e9 == pytest.approx(80.0, rel=0.01)
    # "A3B": about 3B active outside the embedding tables.
    assert 3.0 < (counts.active - counts.embedding) / 1e9 < 3.5


# --- megatron-core TransformerConfig -----------------------------------------------------


def test_megatron_config_needs_vocab_size():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="pass vocab_size="):
        get_flops_estimator(cfg)
    assert "lm_head" not in get_flops_estimator(cfg, vocab_size=0)([4]).by_component


def test_megatron_dense_gqa_equals_same_llama():
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        kv_channels=HD,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
    )
    ours = get_flops_estimator(cfg, vocab_size=V)([5, 50])
    assert ours.by_component == get_flops_estimator(_llama())([5, 50]).by_component


def test_megatron_mla_moe_follows_independent_formula():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = MLATransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        moe_layer_freq=[0, 1],
    )
    out = get_flops_estimator(cfg, vocab_size=V)([1]).by_component
    q = H * 32 + 32 * HEADS * 24
    kv = H * (16 + 8) + 16 * HEADS * (16 + 12)
    o = HEADS * 12 * H
    assert out["attention_projections"] == 6 * 2 * (q + kv + o)
    assert out["dense_mlp"] == 6 * 3 * H * FFN
    assert out["routed_experts"] == 6 * 2 * 3 * H * 32
    assert out["shared_experts"] == 6 * (3 * H * 64 + H)
    assert out["router"] == 6 * H * 8


def test_megatron_gated_delta_net_and_output_gate():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=KV,
        kv_channels=HD,
        ffn_hidden_size=FFN,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,  # layers 0-2 linear, layer 3 softmax attention
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=12,
        attention_output_gate=True,
    )
    out = get_flops_estimator(cfg, vocab_size=V)([1]).by_component
    kd, vd = 2 * 16, 4 * 12
    assert out["linear_attention_projections"] == 6 * 3 * (H * (2 * kd + 2 * vd + 2 * 4) + vd * H)
    assert out["linear_attention_conv"] == 6 * 3 * (2 * kd + vd) * 4
    assert out["linear_attention_core"] == 6 * 3 * 3 * 4 * 16 * 12
    q = 2 * HEADS * HD  # the output gate doubles q
    assert out["attention_projections"] == 6 * (H * (q + 2 * KV * HD) + HEADS * HD * H)


# --- peaks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI300X", 1307.4e12),
        ("cpu", None),
        ("Intel(R) Xeon(R) Platinum", None),
    ],
)
def test_peak_from_device_name(name, peak):
    assert peak_flops_per_second(name) == peak


def test_configured_peak_overrides_table():
    assert resolve_peak_flops("NVIDIA H100 80GB HBM3", 500e12) == 500e12
    assert resolve_peak_flops("cpu", None) is None


# --- CLI ------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", "flops", *args],
        capture_output=True,
        text=True,
    )


def test_cli_json_from_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_llama()))
    proc = _cli("--config", str(path), "--seq-lens", "4", "9", "--no-causal", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    core = 3 * 2 * 2 * HEADS * 2 * HD * (16 + 81)
    assert data["by_component"]["attention_core"] == core
    assert data["total"] == pytest.approx(sum(data["by_component"].values()))


def test_cli_table_from_shipped_model_name():
    proc = _cli("--config", "qwen3-30b-a3b", "--seq-lens", "4096", "4096", "1024")
    assert proc.returncode == 0, proc.stderr
    assert "routed_experts" in proc.stdout and "9216 tokens" in proc.stdout


def test_cli_unknown_config_exits_2_with_choices():
    proc = _cli("--config", "no-such-model", "--seq-lens", "4")
    assert proc.returncode == 2
    assert "qwen3-30b-a3b" in proc.stderr and "Traceback" not in proc.stderr


# --- reference formulas used in docs/en/flops.md ------------------------------------------


def test_torchtitan_style_equals_our_unmasked_count_on_a_dense_model():
    from nemo_moe_metrics.flops.reference import torchtitan_style_flops

    est = get_flops_estimator(load_fixture("llama-3.1-8b"))
    for t in (4096, 32768):
        assert torchtitan_style_flops(est, t) == pytest.approx(
            est([t], causal=False).total, rel=1e-12
        )


def test_megatron_style_differs_from_ours_by_the_diagonal_only_on_a_dense_model():
    from nemo_moe_metrics.flops.reference import megatron_style_flops

    cfg = load_fixture("llama-3.1-8b")
    est = get_flops_estimator(cfg)
    t = 4096
    # T(T+1)/2 attended pairs vs T^2/2: the T/2 diagonal pairs per layer.
    width = cfg["num_attention_heads"] * 2 * 128
    diagonal = 3 * 2 * cfg["num_hidden_layers"] * width * t / 2
    assert est([t]).total - megatron_style_flops(est, t) == pytest.approx(diagonal, rel=1e-9)


# --- properties ---------------------------------------------------------------------------

_lengths = st.lists(st.integers(min_value=0, max_value=70_000), max_size=20)
_GPT_OSS = get_flops_estimator(load_fixture("gpt-oss-120b"))


@settings(max_examples=60, deadline=None)
@given(a=_lengths, b=_lengths)
def test_batches_add_up_sequence_by_sequence(a, b):
    for causal in (True, False):
        joined = _GPT_OSS(a + b, causal=causal).total
        split = _GPT_OSS(a, causal=causal).total + _GPT_OSS(b, causal=causal).total
        assert joined == pytest.approx(split, rel=1e-12, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(lengths=_lengths)
def test_causal_never_exceeds_full_and_window_never_exceeds_causal(lengths):
    causal = _GPT_OSS(lengths).by_component["attention_core"]
    full = _GPT_OSS(lengths, causal=False).by_component["attention_core"]
    unwindowed = get_flops_estimator(
        {**load_fixture("gpt-oss-120b"), "layer_types": ["full_attention"] * 36}
    )(lengths).by_component["attention_core"]
    assert causal <= unwindowed <= full
