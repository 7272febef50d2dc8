"""``aux_loss_tracker: shared`` on two real gloo ranks (megatron-core, both lines).

Shared mode reads megatron's aux-loss tracker without changing it; megatron's own report, called
afterwards on the live tracker as a framework's training_log does, then logs what it logs
without us, and our values equal its values key by key on every rank. One spawn: pipeline
parallel 2 (stage 0 without MoE layers), then the same ranks as expert parallel 2, then
PolicyMetrics steps for the "nothing clears the tracker" warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist import ok_values, run_ranks

from tests.moe.test_aux_loss import SEQ, run_schedule, tracker_snapshot

pytestmark = pytest.mark.megatron


def _shared_then_megatron(config, num_microbatches: int) -> dict:
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics, tracked_aux_loss_names

    before = tracker_snapshot()
    ours = aux_loss_metrics(
        config, num_microbatches=num_microbatches, per_layer=True, tracker="shared"
    )
    after = tracker_snapshot()
    megatron = compat.megatron_reported_aux_losses(  # the live tracker: megatron's own report
        config, num_microbatches=num_microbatches, track_names=tracked_aux_loss_names(config)
    )
    return dict(before=before, after=after, ours=ours, megatron=megatron)


def _scenarios(rank, world_size):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from nemo_moe_metrics.config import MegatronConfig, MetricsConfig, ModelConfig
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    out: dict = {}
    # 1. Pipeline parallel 2: layers 0, 1 dense (stage 0), layers 2, 3 MoE (stage 1).
    pp = MegatronConfig(pipeline_model_parallel_size=2)
    model_cfg = ModelConfig(
        num_layers=4, moe_layer_freq=[0, 0, 1, 1], moe_z_loss_coeff=1e-3, seq_length=SEQ
    )
    init_distributed(pp)
    model = build_gpt_model(model_cfg, pp)
    run_schedule(model, model_cfg, 2, seed=11)
    out["pp"] = _shared_then_megatron(build_transformer_config(model_cfg, pp), 2)

    # 2. Expert parallel 2 (data parallel 2), different tokens per rank.
    ep = MegatronConfig(expert_model_parallel_size=2)
    init_distributed(ep)
    compat.reset_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    cfg = ModelConfig(num_layers=2, moe_z_loss_coeff=1e-3, seq_length=SEQ)
    torch.manual_seed(5)
    model = build_gpt_model(cfg, ep)
    config = build_transformer_config(cfg, ep)
    run_schedule(model, cfg, 2, seed=100 + rank)
    out["ep"] = _shared_then_megatron(config, 2)

    # 3. PolicyMetrics in shared mode: steps with megatron's report after each, then without.
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, aux_loss_tracker="shared"))
    metrics.attach([model], config)
    names = tracked_aux_loss_names(config)
    caught = []

    def step(seed: int, report: bool) -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with metrics.step():
                run_schedule(model, cfg, 2, seed=seed)
            metrics.finish_step(num_microbatches=2)
        caught.append(sum("nothing cleared it" in str(w.message) for w in seen))
        if report:
            compat.megatron_reported_aux_losses(config, num_microbatches=2, track_names=names)

    for seed, report in [(1, True), (2, True), (3, False), (4, False), (5, False)]:
        step(seed + 10 * rank, report)
    out["warnings_per_step"] = caught
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return ok_values(run_ranks(_scenarios, 2, timeout=180))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["pp", "ep"])
def test_shared_mode_leaves_megatrons_tracker_bit_for_bit(two_ranks, layout):
    for result in two_ranks:
        assert result[layout]["after"] == result[layout]["before"]
    # The MoE stage recorded non-zero losses (the tracker was worth protecting).
    assert any(v != 0 for r in two_ranks for vals in r[layout]["before"].values() for v in vals)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["pp", "ep"])
def test_shared_mode_equals_megatrons_own_report_on_every_rank_key_by_key(two_ranks, layout):
    for result in two_ranks:
        ours, megatron = result[layout]["ours"], result[layout]["megatron"]
        assert ours and megatron["moe/load_balancing_loss"] > 0
        for key, value in ours.items():
            assert value == pytest.approx(megatron[key], rel=1e-6, abs=1e-12), key


@pytest.mark.timeout(240)
def test_shared_z_loss_follows_megatrons_reduction_of_this_release(two_ranks):
    # 0.16 leaves z_loss rank-local, 0.19 averages it over data parallel: shared mode is
    # whichever megatron does, so rank values differ exactly when megatron's do.
    mine = [r["ep"]["ours"]["moe/z_loss"] for r in two_ranks]
    theirs = [r["ep"]["megatron"]["moe/z_loss"] for r in two_ranks]
    assert mine == pytest.approx(theirs, rel=1e-6)


@pytest.mark.timeout(240)
def test_shared_mode_warns_once_when_nothing_clears_the_tracker(two_ranks):
    for result in two_ranks:
        # Steps 1-2: megatron's report cleared it; step 3 starts clean (step 2 was reported);
        # step 4 starts with step 3's values: one warning; step 5: not repeated.
        assert result["warnings_per_step"] == [0, 0, 0, 1, 0]
