"""Hybrid MoE models (megatron-core HybridModel on 0.19, MambaModel on 0.16) get the same metrics.

The recipe's pattern ``*E-E*E`` is built on CPU from megatron-core's local modules: attention,
MoE, MLP, MoE, attention, MoE. Expected values come from the pattern itself, megatron's own
report and an independent FLOP counter, never from the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export.metric_names import aux_loss_key, aux_loss_layer_key
from tests.moe.test_aux_loss import MICRO_BATCH, assert_equals_megatrons_report, megatron_report_of

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[3]

RECIPE = ROOT / "examples" / "configs" / "grpo_hybrid_moe_tiny.yaml"

ONE_RANK = "policy.megatron_cfg.expert_model_parallel_size=1"

PATTERN = "*E-E*E"

MOE_LAYERS = [1, 3, 5]  # positions of E in the pattern

LENGTHS = ([16], [5, 11, 9])


def _hybrid_step(rank, world_size):
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_moe_metrics import attach_collector
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron.model import (
        build_model,
        build_transformer_config,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    recipe = load_recipe(RECIPE, [ONE_RANK])
    model_cfg, megatron_cfg = recipe.policy.model, recipe.policy.megatron_cfg
    init_distributed(megatron_cfg)
    torch.manual_seed(0)
    model = build_model(model_cfg, megatron_cfg)
    config = build_transformer_config(model_cfg, megatron_cfg)
    out: dict = {
        "model_class": type(model).__name__,
        "layer_classes": [type(layer).__name__ for layer in model.decoder.layers],
        "layer_parts": [
            sorted(
                name
                for name in ("self_attention", "mlp")
                if type(getattr(layer, name, None)).__name__ not in ("IdentityOp", "NoneType")
            )
            for layer in model.decoder.layers
        ],
        "router_layer_numbers": [
            int(m.layer_number) for m in model.modules() if type(m).__name__ == "TopKRouter"
        ],
    }
    # One training step: router counts and aux losses.
    collector = attach_collector(model)
    s = model_cfg.seq_length
    tokens = torch.randint(0, model_cfg.vocab_size, (MICRO_BATCH, s))
    pos = torch.arange(s).expand(MICRO_BATCH, s)
    model(tokens, pos, causal_attention_mask(s), labels=tokens).mean().backward()
    counts, routed = collector.local_counts()
    out["collector_layers"] = collector.layer_ids
    out["counts"] = [c.tolist() for c in counts]
    out["routed"] = [int(t) for t in routed]
    from nemo_moe_metrics.megatron.compat import tracker_values

    before = {k: v.tolist() for k, v in tracker_values().items()}
    out["tracker_before"] = before
    out["metrics"] = aux_loss_metrics(config, num_microbatches=1, per_layer=True)
    out["megatron"] = megatron_report_of(before, config, 1)
    collector.detach()
    # FLOPs: the pattern estimator against FlopCounterMode on the same model, fwd + bwd.
    est = get_flops_estimator(config, vocab_size=model_cfg.vocab_size)
    flops = {}
    for lengths in LENGTHS:
        counter = FlopCounterMode(display=False)
        with counter:
            for n in lengths:
                ids = torch.randint(0, model_cfg.vocab_size, (1, n))
                loss = model(
                    ids, torch.arange(n).unsqueeze(0), causal_attention_mask(n), labels=ids
                )
                loss.sum().backward()
        model.zero_grad(set_to_none=True)
        estimate = est(lengths, causal=False)
        flops[tuple(lengths)] = (float(counter.get_total_flops()), estimate.to_dict())
    out["flops"] = flops
    return out


@pytest.fixture(scope="module")
def hybrid():
    (result,) = ok_values(run_ranks(_hybrid_step, 1, timeout=240))
    return result


@pytest.mark.timeout(300)
def test_each_pattern_symbol_is_one_layer_of_its_kind(hybrid):
    assert hybrid["model_class"] in ("HybridModel", "MambaModel")
    assert hybrid["layer_parts"] == [
        ["self_attention"],
        ["mlp"],
        ["mlp"],
        ["mlp"],
        ["self_attention"],
        ["mlp"],
    ]
    assert hybrid["layer_classes"][2] == "MLPLayer"


@pytest.mark.timeout(300)
def test_router_layer_ids_are_positions_in_the_pattern(hybrid):
    assert hybrid["router_layer_numbers"] == [i + 1 for i in MOE_LAYERS]
    assert hybrid["collector_layers"] == MOE_LAYERS


@pytest.mark.timeout(300)
def test_counts_sum_to_tokens_times_topk_in_every_moe_layer(hybrid):
    tokens = MICRO_BATCH * 32
    assert hybrid["routed"] == [tokens] * len(MOE_LAYERS)
    assert [sum(c) for c in hybrid["counts"]] == [tokens * 2] * len(MOE_LAYERS)


@pytest.mark.timeout(300)
def test_aux_losses_are_keyed_by_pattern_position_and_averaged_over_moe_layers(hybrid):
    metrics = hybrid["metrics"]
    tracker = hybrid["tracker_before"]["load_balancing_loss"]
    assert len(tracker) == len(PATTERN)
    assert [i for i, v in enumerate(tracker) if v != 0] == MOE_LAYERS
    for layer in MOE_LAYERS:
        assert metrics[aux_loss_layer_key("load_balancing_loss", layer)] == pytest.approx(
            tracker[layer], rel=1e-6
        )
    for layer in (0, 2, 4):
        assert aux_loss_layer_key("load_balancing_loss", layer) not in metrics
    assert metrics[aux_loss_key("load_balancing_loss")] == pytest.approx(
        sum(tracker[i] for i in MOE_LAYERS) / 3, rel=1e-6
    )


@pytest.mark.timeout(300)
def test_hybrid_aux_losses_equal_megatrons_own_report(hybrid):
    assert_equals_megatrons_report(hybrid["metrics"], hybrid["megatron"])


@pytest.mark.timeout(300)
def test_pattern_flop_estimate_matches_flop_counter(hybrid):
    for lengths in LENGTHS:
        counted, estimate = hybrid["flops"][tuple(lengths)]
        parts = estimate["by_component"]
        assert parts["dense_mlp"] > 0 and parts["routed_experts"] > 0
        assert estimate["total"] == pytest.approx(counted, rel=0.005), lengths


# ------------------------------------------------------------------ in-process checks


def test_mamba_and_gdn_symbols_are_refused_with_the_reason():
    from nemo_moe_metrics.megatron.compat import build_hybrid_model

    for pattern in ("M*E", "G*E"):
        with pytest.raises(ValueError, match=r"CUDA kernels|Triton"):
            build_hybrid_model(object(), pattern, vocab_size=8, max_sequence_length=8)


def _megatron_like(**fields):
    base = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        vocab_size=0,
        model_type="megatron_gpt",
    )
    return {**base, **fields}


def test_each_symbol_is_costed_by_its_own_component():
    from nemo_moe_metrics.flops import get_flops_estimator

    mamba = dict(mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8, mamba_num_heads=None)
    gdn = dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    est = get_flops_estimator(_megatron_like(hybrid_layer_pattern="M-GE", **mamba, **gdn))
    parts = est([10]).by_component
    hidden, t = 64, 10
    inner, heads = 2 * hidden, 2 * hidden // 16
    # Hand-computed, one symbol each: M, -, G, E (training = 3 x 2 x multiply-adds).
    in_proj = hidden * (2 * inner + 2 * 2 * 8 + heads)
    assert parts["mamba_projections"] == 6 * t * (in_proj + inner * hidden)
    assert parts["mamba_conv"] == 6 * t * (inner + 2 * 2 * 8) * 4
    assert parts["mamba_core"] == 6 * t * 2 * heads * 16 * 8
    assert parts["dense_mlp"] == 6 * t * 3 * hidden * 128
    assert parts["linear_attention_projections"] > 0
    assert parts["routed_experts"] == 6 * t * 2 * 3 * hidden * 32
    assert "attention_core" not in parts and "attention_projections" not in parts


def test_deepseek_sparse_attention_symbol_has_no_formula():
    from nemo_moe_metrics.flops import get_flops_estimator

    with pytest.raises(ValueError, match="DeepSeek sparse attention"):
        get_flops_estimator(_megatron_like(hybrid_layer_pattern="D-*E"))


def test_mamba_component_matches_a_real_mamba2_mixer_under_flop_counter():
    # megatron's MambaMixer needs the mamba-ssm CUDA kernels; Hugging Face's NemotronH Mamba-2
    # mixer has the same projections and a pure-torch path that runs on CPU.
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    from nemo_moe_metrics.flops import get_flops_estimator

    hf = NemotronHConfig(
        hidden_size=64,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        layers_block_type=["linear_attention"],
        vocab_size=32,
    )
    mixer = nh.NemotronHMamba2Mixer(hf, layer_idx=0).eval()
    n = 24
    counter = FlopCounterMode(display=False)
    # Forward only, but with autograd on: under no_grad a view of a parameter (the mixer's
    # conv1d.weight.squeeze(1)) requires grad without a grad_fn, and transformers hands it to a
    # `kernels` function module whose inputs FlopCounterMode's module tracker hooks: torch then
    # asserts "Expected gradient function to be set".
    with counter:
        mixer(torch.randn(1, n, 64))
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    projections = sum(v for k, v in per_module.items() if k.endswith(("in_proj", "out_proj")))
    est = get_flops_estimator(
        _megatron_like(
            num_layers=1,
            hybrid_layer_pattern="M",
            mamba_head_dim=16,
            mamba_num_groups=2,
            mamba_state_dim=8,
            mamba_num_heads=8,
        )
    )
    parts = est([n]).by_component
    assert parts["mamba_projections"] == pytest.approx(3 * projections, rel=1e-12)
    # The counter counts a padded conv and a chunked scan: check those against the module's
    # own dimensions instead (recurrent-equivalent, as for Gated DeltaNet).
    channels, _, kernel = mixer.conv1d.weight.shape
    assert parts["mamba_conv"] == pytest.approx(3 * 2 * channels * kernel * n, rel=1e-12)
    state = mixer.num_heads * mixer.head_dim * mixer.ssm_state_size
    assert parts["mamba_core"] == pytest.approx(3 * 2 * 2 * state * n, rel=1e-12)


# ------------------------------------------------------------------ the main job, end to end


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_hybrid_recipe_trains_through_run_and_counts_every_token(tmp_path):
    from tests.launch.test_local import (
        check_counts_match_training_tokens,
        launch_recipe,
        metrics_rows,
    )

    launch_recipe(tmp_path, RECIPE)
    run_dir = tmp_path / "runs" / "grpo_hybrid_moe_tiny"
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    check_counts_match_training_tokens(run_dir, rows, moe_layers=tuple(MOE_LAYERS))
    for row in rows:
        for layer in MOE_LAYERS:
            assert aux_loss_layer_key("load_balancing_loss", layer) in row
        assert aux_loss_layer_key("load_balancing_loss", 0) not in row
        assert row["train_perf/estimated_flops"] > 0


def test_hybrid_model_class_follows_the_installed_release():
    import importlib.util

    from nemo_moe_metrics.megatron.compat import hybrid_model_class

    cls, spec_kw, pattern_kw = hybrid_model_class()
    if importlib.util.find_spec("megatron.core.models.hybrid") is not None:
        assert (cls.__name__, spec_kw, pattern_kw) == (
            "HybridModel",
            "hybrid_stack_spec",
            "hybrid_layer_pattern",
        )
    else:
        assert (cls.__name__, spec_kw, pattern_kw) == (
            "MambaModel",
            "mamba_stack_spec",
            "hybrid_override_pattern",
        )
