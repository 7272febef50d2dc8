"""Aux-loss metrics: Megatron's tracker semantics, checked on the real tiny megatron-core model.

Expected values are recomputed here from each router's captured input, weight and routing map
with the Switch-Transformer definition (E * sum_i f_i * P_i), never read from the code under test.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export.metric_names import aux_loss_key, aux_loss_layer_key

pytestmark = pytest.mark.megatron

SEQ = 32
MICRO_BATCH = 2
TOPK = 2
EXPERTS = 8


# ---------------------------------------------------------------- independent oracle (test side)
def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits [tokens, experts] recomputed in float64 from the captured input and weight."""
    hidden, weight = torch.as_tensor(hidden).double(), torch.as_tensor(weight).double()
    return hidden.reshape(-1, hidden.shape[-1]) @ weight.T


def switch_loss(logits: torch.Tensor, routing_map: torch.Tensor, topk: int) -> float:
    """Switch load-balancing loss E * sum_i f_i P_i over one batch of tokens (coefficient 1)."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    fraction_routed = routing_map.double().sum(0) / (tokens * topk)  # f_i
    mean_prob = probs.mean(0)  # P_i
    return float(experts * (fraction_routed * mean_prob).sum())


def z_loss(logits: torch.Tensor) -> float:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (coefficient 1)."""
    return float((torch.logsumexp(logits, dim=-1) ** 2).mean())


def routed_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """The routing map top-k softmax routing should produce, for cross-checking the capture."""
    idx = torch.topk(torch.softmax(logits, -1), topk, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)


# ---------------------------------------------------------------- rank-side helpers
def capture_routers(model, store: list) -> None:
    """Record every router call: global layer, training flags, input, weight, routing map."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(module, args, output):
        store.append(
            dict(
                layer=module.layer_number - 1,
                recorded=module.training and torch.is_grad_enabled(),
                # numpy, not tensors: tensors would cross the result queue as shared memory
                # that vanishes with the spawned rank.
                hidden=args[0].detach().numpy().copy(),
                weight=module.weight.detach().numpy().copy(),
                routing_map=output[1].detach().reshape(-1, module.config.num_moe_experts).numpy(),
            )
        )

    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(hook)


def run_schedule(model, model_cfg, num_microbatches: int, seed: int) -> None:
    """Forward+backward of ``num_microbatches`` microbatches with megatron's own schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import causal_attention_mask

    gen = torch.Generator().manual_seed(seed)
    batches = [
        torch.randint(0, model_cfg.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
        for _ in range(num_microbatches)
    ]
    mask = causal_attention_mask(SEQ)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens, position_ids, mask, labels=tokens)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    with cpu_device_mode():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )


def tracker_snapshot() -> dict[str, list[float]]:
    from nemo_moe_metrics.megatron.compat import tracker_values

    return {k: v.tolist() for k, v in tracker_values().items()}


def megatron_report_of(tracker_before: dict[str, list[float]], config, num_microbatches: int):
    """Megatron's own report (this release's API) of the tracker as it was before our export."""
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    live = compat.tracker_values()
    for name, values in tracker_before.items():
        live[name].copy_(torch.tensor(values))
    return compat.megatron_reported_aux_losses(
        config, num_microbatches=num_microbatches, track_names=tracked_aux_loss_names(config)
    )


def assert_equals_megatrons_report(ours: dict[str, float], megatron: dict[str, float]) -> None:
    """Every aux-loss key we report equals megatron's logged value within 1e-6 relative."""
    assert ours, "no aux-loss metrics to compare"
    for key, value in ours.items():
        assert key in megatron, (key, sorted(megatron))
        assert value == pytest.approx(megatron[key], rel=1e-6, abs=1e-12), key


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _one_rank_scenarios(rank, world_size):
    """One spawned rank, several steps on the tiny model with a dense first layer."""
    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        build_transformer_config,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    megatron_cfg = MegatronConfig()
    model_cfg = ModelConfig(
        num_layers=4,
        num_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_layer_freq=[0, 1, 1, 1],
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        seq_length=SEQ,
    )
    init_distributed(megatron_cfg)
    config = build_transformer_config(model_cfg, megatron_cfg)
    model = build_gpt_model(model_cfg, megatron_cfg)
    calls: list = []
    capture_routers(model, calls)
    handler = _ListHandler()
    logging.getLogger("nemo_moe_metrics.moe.aux_loss").addHandler(handler)
    out: dict = {}

    def step(name, num_microbatches, run):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # A hand-written backward leaves megatron's aux-loss gradient scale as a 0-d tensor and
        # the schedule later copies a [1] tensor into it; start each step from megatron's default.
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        calls.clear()
        run()
        out[name] = dict(
            tracker_before=tracker_snapshot(),
            metrics=aux_loss_metrics(config, num_microbatches=num_microbatches, per_layer=True),
            tracker_after=tracker_snapshot(),
            calls=list(calls),
        )
        out[name]["megatron"] = megatron_report_of(
            out[name]["tracker_before"], config, num_microbatches
        )

    # 1. One microbatch by hand.
    def single():
        tokens = torch.randint(0, model_cfg.vocab_size, (MICRO_BATCH, SEQ))
        pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        model(tokens, pos, causal_attention_mask(SEQ), labels=tokens).mean().backward()

    step("single", 1, single)
    # 2. Four microbatches through megatron's own schedule.
    step("schedule", 4, lambda: run_schedule(model, model_cfg, 4, seed=7))

    # 3. Eval-mode and no-grad forwards record nothing.
    def evaluation():
        tokens = torch.randint(0, model_cfg.vocab_size, (MICRO_BATCH, SEQ))
        pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        model.eval()
        with torch.no_grad():
            model(tokens, pos, causal_attention_mask(SEQ), labels=tokens)
        model.train()
        with torch.no_grad():
            model(tokens, pos, causal_attention_mask(SEQ), labels=tokens)

    step("eval", 1, evaluation)

    # 4. Full activation recomputation: router hooks fire twice, the tracker records once.
    recompute_cfg = MegatronConfig(recompute_granularity="full")
    recompute_model = build_gpt_model(model_cfg, recompute_cfg)
    capture_routers(recompute_model, calls)
    step("recompute", 2, lambda: run_schedule(recompute_model, model_cfg, 2, seed=9))

    # 5. A NaN router weight in global layer 2 gives a NaN loss there.
    from megatron.core.transformer.moe.router import TopKRouter

    routers = {m.layer_number - 1: m for m in model.modules() if isinstance(m, TopKRouter)}
    with torch.no_grad():
        routers[2].weight.fill_(float("nan"))
    handler.lines.clear()
    step("nan", 1, single)
    out["nan"]["warnings"] = list(handler.lines)
    return out


@pytest.fixture(scope="module")
def one_rank():
    (result,) = ok_values(run_ranks(_one_rank_scenarios, 1, timeout=150))
    return result


def expected_per_layer(calls, fn) -> dict[int, float]:
    """Per layer, the mean over that layer's recorded (training, grad) calls of ``fn(call)``."""
    per_layer: dict[int, list[float]] = {}
    for c in calls:
        if c["recorded"]:
            per_layer.setdefault(c["layer"], []).append(fn(c))
    return {layer: sum(v) / len(v) for layer, v in per_layer.items()}


def load_balancing_loss_of(call) -> float:
    logits = router_logits(call["hidden"], call["weight"])
    routing_map = torch.as_tensor(call["routing_map"])
    assert torch.equal(routing_map, routed_topk(logits, TOPK)), "capture mismatch"
    return switch_loss(logits, routing_map, TOPK)


def z_loss_of(call) -> float:
    return z_loss(router_logits(call["hidden"], call["weight"]))


@pytest.mark.timeout(200)
def test_per_layer_load_balancing_loss_equals_switch_loss_recomputed(one_rank):
    res = one_rank["single"]
    expected = expected_per_layer(res["calls"], load_balancing_loss_of)
    assert sorted(expected) == [1, 2, 3]
    for layer, value in expected.items():
        got = res["metrics"][aux_loss_layer_key("load_balancing_loss", layer)]
        assert got == pytest.approx(value, rel=1e-5), layer


@pytest.mark.timeout(200)
def test_per_layer_z_loss_equals_logsumexp_squared_mean(one_rank):
    res = one_rank["single"]
    for layer, value in expected_per_layer(res["calls"], z_loss_of).items():
        got = res["metrics"][aux_loss_layer_key("z_loss", layer)]
        assert got == pytest.approx(value, rel=1e-5), layer


@pytest.mark.timeout(200)
def test_aggregate_is_mean_over_moe_layers_only(one_rank):
    res = one_rank["single"]
    expected = expected_per_layer(res["calls"], load_balancing_loss_of)
    # Three MoE layers (1, 2, 3) out of four: dividing by 4 would under-report by a quarter.
    assert res["metrics"][aux_loss_key("load_balancing_loss")] == pytest.approx(
        sum(expected.values()) / 3, rel=1e-5
    )
    assert aux_loss_layer_key("load_balancing_loss", 0) not in res["metrics"]


@pytest.mark.timeout(200)
def test_several_microbatches_give_mean_per_microbatch_not_sum(one_rank):
    res = one_rank["schedule"]
    calls = res["calls"]
    assert sum(c["recorded"] for c in calls) == 4 * 3  # 4 microbatches x 3 MoE layers
    expected = expected_per_layer(calls, load_balancing_loss_of)
    for layer, mean_value in expected.items():
        # The tracker holds the sum over the four microbatches; the metric is the mean.
        assert res["tracker_before"]["load_balancing_loss"][layer] == pytest.approx(
            4 * mean_value, rel=1e-5
        )
        got = res["metrics"][aux_loss_layer_key("load_balancing_loss", layer)]
        assert got == pytest.approx(mean_value, rel=1e-5)
    assert res["metrics"][aux_loss_key("load_balancing_loss")] == pytest.approx(
        sum(expected.values()) / 3, rel=1e-5
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize("step", ["single", "schedule", "recompute"])
def test_metrics_equal_megatrons_own_report_of_the_same_step(one_rank, step):
    # track_moe_metrics on megatron-core 0.16, get_moe_metrics_tracker().report() on 0.19.
    res = one_rank[step]
    assert_equals_megatrons_report(res["metrics"], res["megatron"])


@pytest.mark.timeout(200)
def test_tracker_is_empty_after_export(one_rank):
    for step in ("single", "schedule"):
        assert any(v != 0 for v in one_rank[step]["tracker_before"]["load_balancing_loss"])
        for name, values in one_rank[step]["tracker_after"].items():
            assert all(v == 0 for v in values), (step, name)


@pytest.mark.timeout(200)
def test_eval_and_no_grad_forwards_add_nothing(one_rank):
    res = one_rank["eval"]
    assert len(res["calls"]) == 2 * 3 and not any(c["recorded"] for c in res["calls"])
    for name, values in res["tracker_before"].items():
        assert all(v == 0 for v in values), name
    assert all(v == 0 for v in res["metrics"].values())


@pytest.mark.timeout(200)
def test_full_recompute_reports_each_microbatch_once(one_rank):
    res = one_rank["recompute"]
    calls = res["calls"]
    # 2 microbatches x 3 MoE layers, each routed twice: once without grad, once recomputed.
    assert len(calls) == 2 * 2 * 3 and sum(c["recorded"] for c in calls) == 2 * 3
    for layer, value in expected_per_layer(calls, load_balancing_loss_of).items():
        got = res["metrics"][aux_loss_layer_key("load_balancing_loss", layer)]
        assert got == pytest.approx(value, rel=1e-5), layer


@pytest.mark.timeout(200)
def test_nan_loss_is_reported_with_a_warning_naming_the_layer(one_rank):
    res = one_rank["nan"]
    metrics = res["metrics"]
    assert math.isnan(metrics[aux_loss_layer_key("load_balancing_loss", 2)])
    assert math.isnan(metrics[aux_loss_key("load_balancing_loss")])
    assert math.isfinite(metrics[aux_loss_layer_key("load_balancing_loss", 1)])
    lines = [w for w in res["warnings"] if "moe/load_balancing_loss" in w]
    assert len(lines) == 1 and "layer 2=nan" in lines[0] and "\n" not in lines[0]


# ---------------------------------------------------------------- config and arithmetic, in-process
def _transformer_config(**overrides):
    """A real megatron TransformerConfig for the tiny model, with TransformerConfig overrides."""
    import dataclasses

    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron.model import build_transformer_config

    model_fields = {k: overrides.pop(k) for k in list(overrides) if k in ModelConfig.model_fields}
    config = build_transformer_config(ModelConfig(**model_fields), MegatronConfig())
    return dataclasses.replace(config, **overrides) if overrides else config


def test_tracked_names_follow_balancing_type_and_z_loss_coefficient():
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    assert tracked_aux_loss_names(_transformer_config()) == ["load_balancing_loss"]
    with_z = _transformer_config(moe_z_loss_coeff=1e-3)
    assert tracked_aux_loss_names(with_z) == ["load_balancing_loss", "z_loss"]
    assert tracked_aux_loss_names(_transformer_config(moe_router_load_balancing_type="none")) == []


def test_seq_aux_loss_does_not_track_load_balancing_loss():
    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    config = _transformer_config(moe_router_load_balancing_type="seq_aux_loss")
    assert tracked_aux_loss_names(config) == ["seq_load_balancing_loss"]


def test_listed_balancing_types_with_zero_coefficient_are_not_tracked():
    import dataclasses

    from nemo_moe_metrics.moe.aux_loss import tracked_aux_loss_names

    config = dataclasses.replace(
        _transformer_config(),
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 0.0, 1e-3],
    )
    assert tracked_aux_loss_names(config) == [
        "load_balancing_loss",
        "global_load_balancing_loss",
    ]


def test_dense_model_tracks_nothing():
    from nemo_moe_metrics.moe.aux_loss import moe_layer_indices, tracked_aux_loss_names

    dense = _transformer_config(num_experts=None)
    assert tracked_aux_loss_names(dense) == [] and moe_layer_indices(dense) == []


@pytest.mark.parametrize(
    ("freq", "layers"),
    [(1, [0, 1, 2, 3]), (2, [0, 2]), ([0, 1, 1, 1], [1, 2, 3]), ([1, 0, 0, 1], [0, 3])],
)
def test_moe_layers_follow_moe_layer_freq(freq, layers):
    from nemo_moe_metrics.moe.aux_loss import moe_layer_indices

    assert moe_layer_indices(_transformer_config(moe_layer_freq=freq)) == layers


def test_mtp_layers_count_as_moe_after_the_decoder_layers_when_the_last_layer_is_moe():
    from nemo_moe_metrics.moe.aux_loss import moe_layer_indices, tracker_length

    config = _transformer_config(moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=1)
    assert moe_layer_indices(config) == [1, 2, 3, 4]
    assert tracker_length(config) == 5
    dense_last = _transformer_config(moe_layer_freq=[1, 1, 1, 0], mtp_num_layers=1)
    assert moe_layer_indices(dense_last) == [0, 1, 2]


def test_summary_averages_moe_layers_and_keys_them_by_global_index():
    from nemo_moe_metrics.moe.aux_loss import summarize_aux_losses

    values = {"load_balancing_loss": [0.0, 1.5, 1.0, 1.25], "z_loss": [0.0, 2.0, 4.0, 6.0]}
    metrics = summarize_aux_losses(values, [1, 2, 3], per_layer=True)
    assert metrics == {
        "moe/load_balancing_loss": pytest.approx((1.5 + 1.0 + 1.25) / 3),
        "moe/load_balancing_loss_layer_1": 1.5,
        "moe/load_balancing_loss_layer_2": 1.0,
        "moe/load_balancing_loss_layer_3": 1.25,
        "moe/z_loss": pytest.approx(4.0),
        "moe/z_loss_layer_1": 2.0,
        "moe/z_loss_layer_2": 4.0,
        "moe/z_loss_layer_3": 6.0,
    }
    assert summarize_aux_losses(values, [1, 2, 3], per_layer=False).keys() == {
        "moe/load_balancing_loss",
        "moe/z_loss",
    }


def test_summary_reports_inf_as_is_with_one_warning_line(caplog):
    from nemo_moe_metrics.moe.aux_loss import summarize_aux_losses

    with caplog.at_level(logging.WARNING, logger="nemo_moe_metrics.moe.aux_loss"):
        metrics = summarize_aux_losses({"z_loss": [1.0, math.inf, 2.0]}, [0, 1, 2], per_layer=False)
    assert metrics["moe/z_loss"] == math.inf
    (record,) = caplog.records
    assert "moe/z_loss" in record.getMessage() and "layer 1=inf" in record.getMessage()


def test_summary_warns_when_a_dense_layer_recorded_a_loss(caplog):
    from nemo_moe_metrics.moe.aux_loss import summarize_aux_losses

    with caplog.at_level(logging.WARNING, logger="nemo_moe_metrics.moe.aux_loss"):
        metrics = summarize_aux_losses(
            {"load_balancing_loss": [0.5, 1.0, 1.0]}, [1, 2], per_layer=False
        )
    assert metrics["moe/load_balancing_loss"] == 1.0
    (record,) = caplog.records
    assert "[0]" in record.getMessage() and "moe_layer_freq" in record.getMessage()


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_microbatch_count_is_rejected_before_any_collective(bad, error):
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    # No process group exists in this process: reaching a collective would fail differently.
    with pytest.raises(error, match="num_microbatches"):
        aux_loss_metrics(_transformer_config(), num_microbatches=bad, per_layer=False)


def test_tracker_of_the_wrong_length_names_both_lengths():
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.moe.aux_loss import local_aux_loss_values

    assert "load_balancing_loss" not in compat.tracker_values()
    compat.put_tracker_entry("load_balancing_loss", torch.zeros(3))
    try:
        with pytest.raises(ValueError, match=r"holds 3 values .* config says 4"):
            local_aux_loss_values(_transformer_config(), ["load_balancing_loss"])
    finally:
        compat.drop_tracker_entry("load_balancing_loss")
    assert "load_balancing_loss" not in compat.tracker_values()


def test_missing_names_are_force_initialised_to_zeros_of_tracker_length():
    from nemo_moe_metrics.moe.aux_loss import local_aux_loss_values

    config = _transformer_config(mtp_num_layers=1)
    values = local_aux_loss_values(config, ["load_balancing_loss", "z_loss"])
    assert values.shape == (2, 5) and values.dtype == torch.float32 and not values.any()
