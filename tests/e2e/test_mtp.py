"""Multi-token-prediction layers are MoE layers like the others: counted, reported, costed.

megatron-core (both lines): a GPTModel built from the SFT recipe (4 layers, the first dense, 8
experts, top-2) plus one MoE multi-token-prediction layer, trained one step on one gloo rank.
Its MTP router (``layer_number = num_layers + 1``) is counted as global layer ``num_layers``;
the counts equal the routing maps the routers returned (an independent forward hook); the aux
losses equal megatron-core's own report of the same tracker (``aux_loss_tracker: shared``); the
FLOP estimate includes the MTP block and matches FlopCounterMode on the model with MTP as
closely as on the same model without it.

torchtitan's DeepSeek-V3 with ``mtp_layers``: its MTP router counts as layer ``len(layers)``
and the estimate equals FlopCounterMode.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
ONE_RANK = "policy.megatron_cfg.expert_model_parallel_size=1"
SEQ = 16


def _megatron_mtp(rank, world_size):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_moe_metrics.config import MetricsConfig, load_recipe
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.model import (
        apply_cpu_shims,
        build_transformer_config,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    recipe = load_recipe(RECIPE, [ONE_RANK])
    model_cfg, megatron_cfg = recipe.policy.model, recipe.policy.megatron_cfg
    init_distributed(megatron_cfg)
    apply_cpu_shims()
    out = {"num_layers": model_cfg.num_layers}

    def build(mtp: int):
        config = build_transformer_config(model_cfg, megatron_cfg)
        if mtp:
            config = dataclasses.replace(config, mtp_num_layers=mtp)
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
        mtp_spec = (
            get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
        )
        torch.manual_seed(0)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.seq_length,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
            mtp_block_spec=mtp_spec,
        )
        return config, model

    def forward(model, seed: int):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, model_cfg.vocab_size, (1, SEQ), generator=g)
        positions = torch.arange(SEQ).unsqueeze(0)
        return model(tokens, positions, causal_attention_mask(SEQ), labels=tokens).sum()

    # FLOPs: estimate / FlopCounterMode, with and without the MTP layer.
    for mtp in (0, 1):
        config, model = build(mtp)
        counter = FlopCounterMode(display=False)
        with counter:
            forward(model, 0).backward()
        estimate = get_flops_estimator(config, vocab_size=model_cfg.vocab_size)([SEQ], causal=False)
        out[f"flops_ratio_{mtp}"] = estimate.total / counter.get_total_flops()
        out[f"flops_components_{mtp}"] = dict(estimate.by_component)
        compat.reset_tracker()

    # Counts and aux losses on the MTP model.
    config, model = build(1)
    routed: dict[int, np.ndarray] = {}

    def record(router, args, output, layer):
        routed[layer] = routed.get(layer, 0) + output[1].sum(dim=0).numpy()

    for name, module in model.named_modules():
        if compat.is_megatron_router(module):
            # megatron's own numbering: 0.16 continues after the decoder, 0.19 restarts at 1
            # inside the MTP block and flags the router is_mtp_layer.
            number = int(module.layer_number)
            if "mtp" in name.split("."):
                out["mtp_router_number"] = number
                if getattr(module, "is_mtp_layer", False):
                    number += model_cfg.num_layers
            module.register_forward_hook(lambda m, a, o, layer=number - 1: record(m, a, o, layer))
    cfg = MetricsConfig(
        track_moe_metrics=True, moe_per_layer_logging=True, aux_loss_tracker="shared"
    )
    metrics = PolicyMetrics(cfg, vocab_size=model_cfg.vocab_size)
    metrics.attach([model], config)
    with metrics.step():
        forward(model, 1).backward()
    out["ours"] = metrics.finish_step(num_microbatches=1)
    out["megatron"] = compat.megatron_reported_aux_losses(
        config, num_microbatches=1, track_names=tracked_aux_loss_names(config)
    )
    out["routed"] = {k: v.tolist() for k, v in routed.items()}
    return out


@pytest.fixture(scope="module")
def megatron_mtp():
    (result,) = ok_values(run_ranks(_megatron_mtp, 1, timeout=240))
    return result


def _table(metrics):
    table: dict[int, dict[int, int]] = {}
    for layer, expert, tokens, _ in metrics["moe/expert_loads"]:
        table.setdefault(layer, {})[expert] = tokens
    return {layer: [t[e] for e in sorted(t)] for layer, t in table.items()}


@pytest.mark.timeout(300)
def test_megatron_mtp_router_is_counted_as_the_layer_after_the_decoder(megatron_mtp):
    n = megatron_mtp["num_layers"]
    assert megatron_mtp["mtp_router_number"] in (n + 1, 1)  # 0.16, 0.19
    table = _table(megatron_mtp["ours"])
    routed = {int(k): v for k, v in megatron_mtp["routed"].items()}
    assert sorted(table) == sorted(routed) == [1, 2, 3, n]  # dense layer 0; MTP last
    for layer, counts in routed.items():
        assert table[layer] == counts, layer
    assert sum(table[n]) == SEQ * 2  # every token of the MTP layer, top-2


@pytest.mark.timeout(300)
def test_megatron_mtp_aux_losses_equal_megatrons_own_report(megatron_mtp):
    n = megatron_mtp["num_layers"]
    ours, megatron = megatron_mtp["ours"], megatron_mtp["megatron"]
    aux = {k: v for k, v in ours.items() if "_loss" in k}
    assert f"moe/load_balancing_loss_layer_{n}" in aux
    for key, value in aux.items():
        assert value == pytest.approx(megatron[key], rel=1e-6), key


@pytest.mark.timeout(300)
def test_megatron_mtp_flops_include_the_mtp_block(megatron_mtp):
    with_mtp, without = megatron_mtp["flops_ratio_1"], megatron_mtp["flops_ratio_0"]
    assert with_mtp == pytest.approx(without, rel=0.02)
    assert with_mtp == pytest.approx(1.0, rel=0.01)
    components = megatron_mtp["flops_components_1"]
    plain = megatron_mtp["flops_components_0"]
    assert components["mtp_projection"] > 0 and "mtp_projection" not in plain
    assert components["lm_head"] == pytest.approx(2 * plain["lm_head"])


@pytest.mark.torchtitan
def test_torchtitan_mtp_layer_is_counted_and_costed():
    pytest.importorskip("torchtitan")
    import copy

    import torch
    from torch.nn.attention import SDPBackend
    from torch.utils.flop_counter import FlopCounterMode
    from torchtitan.models import deepseek_v3 as ds
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.integrations import torchtitan as tt
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics
    from tests.integrations.test_torchtitan import grouped_mm_flop

    config = tt.use_sdpa_attention(tt.tiny_config("deepseek_v3", layers=3))
    last = copy.deepcopy(config.layers[-1])
    config.mtp_layers = ds._build_mtp_layers(last, dim=config.dim, num_mtp_layers=1)
    model = tt.build_model(config).train()
    for m in model.modules():
        if isinstance(m, ScaledDotProductAttention):
            m.sdpa_backends = [SDPBackend.MATH]  # the CPU flash kernel counts 0
    routed: dict[int, np.ndarray] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "TokenChoiceTopKRouter":
            layer = 3 if name.startswith("mtp_layers.") else int(name.split(".")[1])

            def record(m, a, out, layer=layer):
                ids = out[1].reshape(-1).numpy()
                routed[layer] = routed.get(layer, 0) + np.bincount(ids, minlength=8)

            module.register_forward_hook(record)
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True))
    metrics.attach(model, config)
    tokens = torch.randint(
        0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0)
    )
    # aten._grouped_mm counts 0 in FlopCounterMode: test_torchtitan's mapping counts it.
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flop}
    )
    with metrics.step(), counter:
        outputs = model(tokens)
        sum(o.float().sum() for o in outputs).backward()
    step = metrics.finish_step(num_microbatches=1)
    table = _table(step)
    assert sorted(table) == sorted(routed) == [1, 2, 3]  # layer 0 dense; MTP = layer 3
    for layer, counts in routed.items():
        assert table[layer] == counts.tolist(), layer
    estimate = get_flops_estimator(config)([SEQ, SEQ], causal=False)
    assert estimate.by_component["mtp_projection"] > 0
    assert estimate.total == pytest.approx(counter.get_total_flops(), rel=1e-6)
