"""Routing consistency without megatron: the arithmetic, the shape checks, alerts, the report.

Expected values are worked out by hand from small examples (the same as docs/en/
routing_consistency.md); the megatron oracle tests live in adapters/test_megatron_routing.py.
"""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from nemo_moe_metrics.config import AlertsConfig, LoggerConfig, MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.routing import (
    RoutingShapeError,
    RoutingTracker,
    check_routes,
    in_router_order,
    indices_to_map,
    route_memory_bytes,
    routing_metrics,
)
from nemo_moe_metrics.report import ROUTING_DISAGREEMENT_FILE, render_report
from nemo_moe_metrics.sinks import build_sinks
from nemo_moe_metrics.sinks.alerts import AlertMonitor

pytestmark = pytest.mark.megatron

E = 8


def _tracker(layers=(1, 2)):
    return RoutingTracker(
        list(layers), list(layers), 2, [E] * len(layers), torch.device("cpu"), sequence_major=False
    )


def _metrics(tracker):
    stats, tokens = tracker.local_stats()
    return routing_metrics(tracker.layer_ids, stats.numpy(), tokens.numpy(), 2, per_layer=True)


def test_worked_example_from_the_docs():
    # 4 tokens, 2 MoE layers, top-2. Token 3 has no rollout route (-1).
    rollout = torch.tensor(
        [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
            [[0, 2], [1, 3]],
            [[-1, -1], [-1, -1]],
        ]
    )
    training = {  # the training routers' own choices
        1: torch.tensor([[1, 0], [4, 6], [0, 2], [3, 4]]),  # same, half, same, (no route)
        2: torch.tensor([[2, 3], [6, 7], [5, 6], [0, 1]]),  # same, same, none, (no route)
    }
    t = _tracker()
    t.set_routes(rollout)
    for layer, chosen in training.items():
        m = indices_to_map(chosen, E)
        t.observe(layer, m, m, None, replay=False)
    got = _metrics(t)
    # Routed pairs: 3 per layer = 6. Differ: (token 1, layer 1), (token 2, layer 2) = 2.
    assert got[mn.ROUTING_DISAGREEMENT] == 2 / 6
    # Overlaps: layer 1: 2 + 1 + 2, layer 2: 2 + 2 + 0 -> 9 of 12.
    assert got[mn.ROUTING_TOPK_OVERLAP] == 9 / 12
    # Tokens routed on both layers: 0, 1, 2; token 1 and 2 differ somewhere.
    assert got[mn.ROUTING_TOKENS_ANY_LAYER_DIFFERS] == 2 / 3
    assert got[mn.ROUTING_MISSING_FRACTION] == 2 / 8
    assert got["moe/layer_1/routing_disagreement"] == 1 / 3
    assert got["moe/layer_2/routing_topk_overlap"] == 4 / 6
    assert mn.ROUTING_REPLAY_MISMATCH not in got


def test_replay_mismatch_compares_executed_experts_and_padding_is_excluded():
    t = _tracker(layers=(0,))
    rollout = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]])
    t.set_routes(rollout)
    own = indices_to_map(torch.tensor([[0, 1], [2, 4], [6, 7]]), E)
    executed = indices_to_map(torch.tensor([[0, 1], [2, 3], [0, 7]]), E)
    valid = torch.tensor([True, True, False])  # token 2 is padding
    t.observe(0, own, executed, valid, replay=True)
    got = _metrics(t)
    assert got[mn.ROUTING_REPLAY_MISMATCH] == 0.0  # token 2 (mismatching) is padding
    assert got[mn.ROUTING_DISAGREEMENT] == 1 / 2
    assert got[mn.ROUTING_MISSING_FRACTION] == 0.0


def test_repeated_ids_or_a_partial_row_are_not_routes():
    t = _tracker(layers=(0,))
    t.set_routes(torch.tensor([[[1, 1]], [[0, -1]], [[0, 1]]]))
    m = indices_to_map(torch.tensor([[0, 1]] * 3), E)
    t.observe(0, m, m, None, replay=False)
    got = _metrics(t)
    assert got[mn.ROUTING_MISSING_FRACTION] == 2 / 3
    assert got[mn.ROUTING_DISAGREEMENT] == 0.0


@pytest.mark.parametrize("bad_id", [E, 99, -2])
def test_an_out_of_range_expert_id_is_an_error_naming_the_layer(bad_id):
    t = _tracker(layers=(0, 3))
    routes = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, bad_id]], [[4, 5], [6, 7]]])
    t.set_routes(routes)
    m = indices_to_map(torch.tensor([[0, 1]] * 3), E)
    for layer in (0, 3):
        t.observe(layer, m, m, None, replay=False)
    with pytest.raises(ValueError, match=r"outside \[-1, num_experts\) for 1 .*\(layer 3: 1\)"):
        _metrics(t)


def test_an_out_of_range_id_on_padding_is_ignored():
    t = _tracker(layers=(0,))
    t.set_routes(torch.tensor([[[0, 1]], [[0, 99]]]))
    m = indices_to_map(torch.tensor([[0, 1]] * 2), E)
    t.observe(0, m, m, torch.tensor([True, False]), replay=False)
    assert _metrics(t)[mn.ROUTING_DISAGREEMENT] == 0.0


def test_no_pair_with_a_route_logs_no_ratio_instead_of_zero():
    t = _tracker(layers=(0,))
    t.set_routes(torch.full((3, 1, 2), -1))
    m = indices_to_map(torch.tensor([[0, 1]] * 3), E)
    t.observe(0, m, m, None, replay=False)
    got = _metrics(t)
    assert got == {mn.ROUTING_MISSING_FRACTION: 1.0}  # disagreement 0/0: not logged


def test_routes_given_after_the_forward_are_refused():
    t = _tracker(layers=(0,))
    m = indices_to_map(torch.tensor([[0, 1]] * 2), E)
    t.set_routes(None)
    t.observe(0, m, m, None, replay=False)  # the forward ran without routes...
    t.set_routes(torch.tensor([[[0, 1]], [[2, 3]]]))  # ...then its routes came
    with pytest.raises(RoutingShapeError, match="never used.*before its forward"):
        _metrics(t)


def test_padded_routes_become_the_routers_token_order():
    b, s = 2, 3
    routes = torch.arange(b * s * 2 * 2, dtype=torch.int32).reshape(b, s, 2, 2)
    stacked = torch.stack([routes, routes + 100])  # two microbatches
    seq_major = in_router_order(stacked, sequence_major=True)
    batch_major = in_router_order(stacked, sequence_major=False)
    assert seq_major.shape == (2, b * s, 2, 2) and seq_major.dtype == torch.int64
    assert torch.equal(seq_major[0, 1], routes[1, 0].long())  # [s*b]: token (s=0, b=1) second
    assert torch.equal(batch_major[1, 1], routes[0, 1].long() + 100)


def test_routes_written_in_place_before_the_step_ends_are_an_error():
    # Routes are read by the step's batched pass, not copied by microbatch(): a buffer reused
    # for the next microbatch would be compared with the wrong forward, so it is refused.
    t = _tracker(layers=(0,))
    routes = torch.tensor([[[0, 1]], [[2, 3]]])
    m = indices_to_map(routes[:, 0], E)
    t.set_routes(routes)
    t.observe(0, m, m, None, replay=False)
    routes.copy_(torch.tensor([[[4, 5]], [[6, 7]]]))  # the next microbatch's routes, same buffer
    t.set_routes(routes)
    t.observe(0, indices_to_map(routes[:, 0], E), m, None, replay=False)
    with pytest.raises(RoutingShapeError, match=r"written in place.*\(1 microbatch"):
        _metrics(t)
    t.reset()  # a fresh tensor per microbatch is compared as given
    t.set_routes(routes.clone())
    t.observe(0, indices_to_map(routes[:, 0], E), m, None, replay=False)
    assert _metrics(t)[mn.ROUTING_DISAGREEMENT] == 0.0


@pytest.mark.parametrize(
    "shape,needle",
    [((5, 3, 2), "(5, 3, 2) (3 MoE layers)"), ((5, 2, 4), "(5, 2, 4)"), ((5, 2), "(5, 2)")],
)
def test_shape_mismatch_names_both_shapes(shape, needle):
    with pytest.raises(RoutingShapeError) as err:
        check_routes(torch.zeros(shape, dtype=torch.long), num_moe_layers=2, topk=2)
    assert needle in str(err.value) and "[tokens, 2, 2]" in str(err.value)


def test_token_count_mismatch_is_raised_in_the_forward():
    t = _tracker()
    t.set_routes(torch.zeros(5, 2, 2, dtype=torch.long))
    m = indices_to_map(torch.zeros(4, 2, dtype=torch.long), E)
    with pytest.raises(RoutingShapeError, match=r"\(5, 2, 2\).*saw 4 tokens"):
        t.observe(1, m, m, None, replay=False)


def test_flag_needs_track_moe_metrics():
    with pytest.raises(ValueError, match="track_routing_consistency"):
        MetricsConfig(track_routing_consistency=True)


def test_route_memory_at_94_layers_top8_32k_tokens():
    # int64 routes [32768, 94, 8]: 197,132,288 bytes = 188 MiB per microbatch.
    assert route_memory_bytes(32 * 1024, 94, 8) == 32768 * 94 * 8 * 8 == 197_132_288


def test_alert_names_the_layer_over_the_threshold(caplog):
    monitor = AlertMonitor(AlertsConfig(enabled=True, routing_disagreement=0.2))
    metrics = {
        mn.ROUTING_DISAGREEMENT: 0.15,
        "moe/layer_1/routing_disagreement": 0.05,
        "moe/layer_3/routing_disagreement": 0.3,
    }
    with caplog.at_level(logging.WARNING, "nemo_moe_metrics.alerts"):
        assert monitor.observe(metrics, 4) == {mn.ALERTS: 1}
        assert monitor.observe(metrics, 5) == {mn.ALERTS: 0}  # still holding: warns once
    assert "layer 3 routing disagreement 30.0%" in caplog.text
    only_global = AlertMonitor(AlertsConfig(enabled=True, routing_disagreement=0.1))
    assert only_global.observe({mn.ROUTING_DISAGREEMENT: 0.15}, 0) == {mn.ALERTS: 1}


def test_report_draws_per_layer_disagreement_and_names_worst_layers(tmp_path: Path):
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1)
    sink = build_sinks(cfg, tmp_path, run_name="r3", config={})
    for step in range(4):
        sink.log(
            {
                mn.ROUTING_DISAGREEMENT: 0.1,
                mn.ROUTING_MISSING_FRACTION: 0.0,
                "moe/layer_1/routing_disagreement": 0.02 * step,
                "moe/layer_2/routing_disagreement": 0.3,
                "moe/layer_3/routing_disagreement": 0.1,
            },
            step,
        )
    sink.close()
    summary = render_report(tmp_path)
    assert "worst layers (mean over 4 steps): layer 2 30.00%, layer 3 10.00%, layer 1 3.00%" in (
        summary
    )
    assert "routing disagreement (last step, moe/routing_disagreement): 10.00%" in summary
    picture = imread(tmp_path / ROUTING_DISAGREEMENT_FILE)
    assert picture.shape[0] > 300 and np.ptp(picture[..., :3]) > 0


def test_hugging_face_router_batch_major_routes_against_router_output_hooks():
    """qwen3_moe: rollout routes from its routers' outputs under bf16 autocast, training fp32;
    expected values from independent hooks on the routers (output[2], the top-k indices)."""
    import transformers
    from hf_tiny import tiny_config

    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2].clone())) for r in routers]
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    rollout = torch.stack([t.reshape(2, 24, 2) for t in seen], dim=2)  # [b, s, L, k]
    rollout[1, 20:] = -1  # no route captured for the tail of sequence 1
    seen.clear()
    model.train()
    metrics = PolicyMetrics(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True,
                      track_routing_consistency=True, log_expert_table=False)
    )  # fmt: skip
    metrics.attach(model, model.config)
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([24, 24]), rollout_routes=rollout)
        model(tokens).logits.float().mean().backward()
    got = metrics.finish_step(num_microbatches=1)
    for h in handles:
        h.remove()
    train = torch.stack([t.reshape(2, 24, 2) for t in seen], dim=2)
    routed = (rollout >= 0).all(-1)  # [b, s, L]
    same = torch.tensor(
        [
            [[set(rollout[b, s, j].tolist()) == set(train[b, s, j].tolist()) for j in range(2)]
             for s in range(24)]
            for b in range(2)
        ]
    )  # fmt: skip
    differ = routed & ~same
    assert got[mn.ROUTING_DISAGREEMENT] == differ.sum().item() / routed.sum().item()
    assert got[mn.ROUTING_MISSING_FRACTION] == (~routed).sum().item() / routed.numel()
    for j in range(2):
        assert got[f"moe/layer_{j}/routing_disagreement"] == (
            differ[..., j].sum().item() / routed[..., j].sum().item()
        )
    all_routed = routed.all(-1)
    assert got[mn.ROUTING_TOKENS_ANY_LAYER_DIFFERS] == (
        (differ.any(-1) & all_routed).sum().item() / all_routed.sum().item()
    )


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_chance_levels_the_docs_give_are_what_random_routes_measure(lang):
    """Routes drawn at random (a misalignment) against a router's own top-2 of 8: the docs'
    disagreement 1 - 1/C(8, 2) = 0.964 and overlap top_k / E = 0.25, not 1 - top_k / E."""
    from math import comb

    gen = torch.Generator().manual_seed(0)
    tokens = 20_000
    rollout = torch.rand(tokens, E, generator=gen).topk(2, dim=1).indices  # k distinct, uniform
    own = torch.rand(tokens, E, generator=gen).topk(2, dim=1).indices
    t = _tracker(layers=(0,))
    t.set_routes(rollout.reshape(tokens, 1, 2))
    m = indices_to_map(own, E)
    t.observe(0, m, m, None, replay=False)
    got = _metrics(t)
    assert got[mn.ROUTING_DISAGREEMENT] == pytest.approx(1 - 1 / comb(E, 2), abs=0.005)
    assert got[mn.ROUTING_TOPK_OVERLAP] == pytest.approx(2 / E, abs=0.01)
    doc = Path(__file__).resolve().parents[2] / "docs" / lang / "routing_consistency.md"
    text = " ".join(doc.read_text(encoding="utf-8").split())
    assert "`1 - 1 / C(num_experts, top_k)`" in text and "0.96" in text
    assert (
        "near `1 - top_k / num_experts`" not in text
        and "接近 `1 - top_k / num_experts`" not in text
    )
