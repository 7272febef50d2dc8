"""Aux-loss metrics across two real gloo ranks: pipeline stages without MoE layers, data parallel.

One spawn serves every test here: first pipeline parallel 2 with all MoE layers on the second
stage (the first stage's tracker stays empty: the case that hung NeMo RL), then the same two
ranks re-initialised as data parallel 2 (expert parallel 2) to check Megatron's reductions.
"""

from __future__ import annotations

import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export.metric_names import aux_loss_key, aux_loss_layer_key
from tests.moe.test_aux_loss import (
    MICRO_BATCH,
    SEQ,
    TOPK,
    assert_equals_megatrons_report,
    capture_routers,
    expected_per_layer,
    load_balancing_loss_of,
    megatron_report_of,
    router_logits,
    run_schedule,
    switch_loss,
    tracker_snapshot,
    z_loss_of,
)

pytestmark = pytest.mark.megatron


def _train_once(model, model_cfg, seed: int) -> None:
    from nemo_moe_metrics.megatron.model import causal_attention_mask

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    model(tokens, pos, causal_attention_mask(SEQ), labels=tokens).mean().backward()


def _two_rank_scenarios(rank, world_size):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron.compat import reset_tracker
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    out: dict = {}
    # Part 1: pipeline parallel 2; layers 0, 1 (stage 0) dense, layers 2, 3 (stage 1) MoE.
    pp_cfg = MegatronConfig(pipeline_model_parallel_size=2)
    model_cfg = ModelConfig(
        num_layers=4, moe_layer_freq=[0, 0, 1, 1], moe_z_loss_coeff=1e-3, seq_length=SEQ
    )
    init_distributed(pp_cfg)
    config = build_transformer_config(model_cfg, pp_cfg)
    model = build_gpt_model(model_cfg, pp_cfg)
    calls: list = []
    capture_routers(model, calls)
    run_schedule(model, model_cfg, 2, seed=11)
    before = tracker_snapshot()
    out["pp_tracker_names"] = sorted(before)
    out["pp_metrics"] = aux_loss_metrics(config, num_microbatches=2, per_layer=True)
    out["pp_megatron"] = megatron_report_of(before, config, 2)
    out["pp_calls"] = calls

    # Part 2: the same ranks as data parallel 2 (each holds 4 of 8 experts), different data.
    dp_cfg = MegatronConfig(expert_model_parallel_size=2)
    init_distributed(dp_cfg)
    for balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        # A new model with fewer layers in the same process: drop megatron's 4-layer vectors.
        reset_tracker()
        cfg = ModelConfig(
            num_layers=2,
            moe_router_load_balancing_type=balancing,
            moe_z_loss_coeff=1e-3,
            seq_length=SEQ,
        )
        torch.manual_seed(5)  # identical non-expert weights on both ranks, as in real DP
        model = build_gpt_model(cfg, dp_cfg)
        calls = []
        capture_routers(model, calls)
        _train_once(model, cfg, seed=100 + rank)
        config = build_transformer_config(cfg, dp_cfg)
        before = tracker_snapshot()
        metrics = aux_loss_metrics(config, num_microbatches=1, per_layer=True)
        megatron = megatron_report_of(before, config, 1)
        out[balancing] = dict(metrics=metrics, calls=calls, megatron=megatron)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    # The timeout turns a hang in the collective into a failure instead of a stuck suite.
    return ok_values(run_ranks(_two_rank_scenarios, 2, timeout=150))


@pytest.mark.timeout(220)
def test_stage_without_moe_layers_joins_export_without_hanging(two_ranks):
    first, last = two_ranks
    assert first["pp_tracker_names"] == []  # stage 0 never recorded anything
    assert last["pp_tracker_names"] == ["load_balancing_loss", "z_loss"]
    assert first["pp_metrics"] == last["pp_metrics"]


@pytest.mark.timeout(220)
def test_pipeline_stages_report_the_moe_stage_values_averaged_over_moe_layers(two_ranks):
    first, last = two_ranks
    assert not first["pp_calls"]
    expected = expected_per_layer(last["pp_calls"], load_balancing_loss_of)
    assert sorted(expected) == [2, 3]
    metrics = first["pp_metrics"]
    for layer, value in expected.items():
        assert metrics[aux_loss_layer_key("load_balancing_loss", layer)] == pytest.approx(
            value, rel=1e-5
        )
    assert metrics[aux_loss_key("load_balancing_loss")] == pytest.approx(
        sum(expected.values()) / 2, rel=1e-5
    )


@pytest.mark.timeout(220)
def test_pipeline_stages_equal_megatrons_own_report_on_every_rank(two_ranks):
    # One stage without MoE layers: megatron force-initialises it, we read zeros.
    for result in two_ranks:
        assert_equals_megatrons_report(result["pp_metrics"], result["pp_megatron"])


@pytest.mark.timeout(220)
@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_load_balancing_losses_equal_megatrons_own_report_on_every_rank(two_ranks, balancing):
    for result in two_ranks:
        ours = {k: v for k, v in result[balancing]["metrics"].items() if "z_loss" not in k}
        assert_equals_megatrons_report(ours, result[balancing]["megatron"])


@pytest.mark.timeout(220)
def test_z_loss_equals_the_data_parallel_mean_of_megatrons_report(two_ranks):
    # megatron-core 0.16 logs each rank's own z-loss, 0.19 averages it over the ranks; we report
    # the average on every rank, which is the mean of megatron's per-rank values on both.
    keys = [k for k in two_ranks[0]["aux_loss"]["metrics"] if "z_loss" in k]
    assert keys
    for key in keys:
        mean = sum(r["aux_loss"]["megatron"][key] for r in two_ranks) / len(two_ranks)
        for result in two_ranks:
            assert result["aux_loss"]["metrics"][key] == pytest.approx(mean, rel=1e-6), key


def _per_rank(two_ranks, balancing, fn):
    return [expected_per_layer(r[balancing]["calls"], fn) for r in two_ranks]


@pytest.mark.timeout(220)
def test_load_balancing_loss_is_averaged_over_data_parallel_ranks(two_ranks):
    r0, r1 = _per_rank(two_ranks, "aux_loss", load_balancing_loss_of)
    assert r0[0] != pytest.approx(r1[0], rel=1e-3)  # different data on each rank
    for result in two_ranks:
        metrics = result["aux_loss"]["metrics"]
        for layer in (0, 1):
            assert metrics[aux_loss_layer_key("load_balancing_loss", layer)] == pytest.approx(
                (r0[layer] + r1[layer]) / 2, rel=1e-5
            )


@pytest.mark.timeout(220)
def test_z_loss_is_averaged_over_data_parallel_ranks(two_ranks):
    r0, r1 = _per_rank(two_ranks, "aux_loss", z_loss_of)
    for result in two_ranks:
        metrics = result["aux_loss"]["metrics"]
        for layer in (0, 1):
            assert metrics[aux_loss_layer_key("z_loss", layer)] == pytest.approx(
                (r0[layer] + r1[layer]) / 2, rel=1e-5
            )


def _seq_loss(call) -> float:
    """Sequence-level balance loss: the switch loss of each sequence alone, averaged."""
    logits = router_logits(call["hidden"], call["weight"])
    routing = torch.as_tensor(call["routing_map"])
    experts = logits.shape[-1]
    # Router tokens are [seq, batch] flattened: sequence b is every MICRO_BATCH-th token.
    logits = logits.view(SEQ, MICRO_BATCH, experts)
    routing = routing.view(SEQ, MICRO_BATCH, experts)
    losses = [switch_loss(logits[:, b], routing[:, b], TOPK) for b in range(MICRO_BATCH)]
    return sum(losses) / MICRO_BATCH


@pytest.mark.timeout(220)
def test_seq_load_balancing_loss_is_per_sequence_mean_averaged_over_ranks(two_ranks):
    r0, r1 = _per_rank(two_ranks, "seq_aux_loss", _seq_loss)
    for result in two_ranks:
        metrics = result["seq_aux_loss"]["metrics"]
        assert aux_loss_key("load_balancing_loss") not in metrics
        for layer in (0, 1):
            assert metrics[aux_loss_layer_key("seq_load_balancing_loss", layer)] == pytest.approx(
                (r0[layer] + r1[layer]) / 2, rel=1e-5
            )


@pytest.mark.timeout(220)
def test_global_load_balancing_loss_is_switch_loss_over_both_ranks_tokens(two_ranks):
    for layer in (0, 1):
        calls = [
            next(c for c in r["global_aux_loss"]["calls"] if c["layer"] == layer and c["recorded"])
            for r in two_ranks
        ]
        logits = torch.cat([router_logits(c["hidden"], c["weight"]) for c in calls])
        routing = torch.cat([torch.as_tensor(c["routing_map"]) for c in calls])
        expected = switch_loss(logits, routing, TOPK)
        for result in two_ranks:
            key = aux_loss_layer_key("global_load_balancing_loss", layer)
            assert result["global_aux_loss"]["metrics"][key] == pytest.approx(expected, rel=1e-5)
