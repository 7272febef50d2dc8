"""Router decision health on Hugging Face and torchtitan routers, and its arithmetic alone.

Expected values come from ``health_oracle`` (numpy, float64) over what each router produced in
the test's own forward hooks: its logits, the indices it returned, its bias at that moment.
One and two ranks (data parallel, gloo); the key set stays bounded without per-layer logging.
"""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from dist import ok_values, run_ranks
from health_oracle import NEAR_TIE_GAP, Layer, Router, assert_matches, expected_keys
from hf_tiny import FAMILIES, VOCAB, K, tiny_model

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.families.router_health import enable_health
from nemo_moe_metrics.moe.router_health import (
    RouterScoring,
    chosen_experts,
    chosen_ids,
    decision_sums,
    decision_table,
    router_health_metrics,
)

torch.set_num_threads(1)


def _router_of(family: str, cfg) -> Router:
    e = cfg.get_text_config()
    experts = next(getattr(e, f) for f in ("num_experts", "num_local_experts", "n_routed_experts")
                   if getattr(e, f, None))  # fmt: skip
    if family == "deepseek_v3":
        return Router("sigmoid", experts, K, groups=e.n_group, group_topk=e.topk_group)
    return Router("softmax", experts, K)


class _Probe:
    """Records each router forward: logits, its own indices as a map, its bias then."""

    def __init__(self, model, router: Router):
        self.router, self.layers, self.handles = router, {}, []
        for name, m in model.named_modules():
            if name.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "top_k"):
                layer = int(name.split("layers.")[1].split(".")[0])
                self.handles.append(m.register_forward_hook(self._hook(layer)))

    def _hook(self, layer):
        def hook(module, args, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            idx = output[2].reshape(-1, self.router.topk)
            chosen = torch.zeros(idx.shape[0], self.router.num_experts, dtype=torch.bool)
            chosen.scatter_(1, idx, True)
            bias = getattr(module, "e_score_correction_bias", None)
            self.layers.setdefault(layer, Layer()).add(
                self.router,
                output[0].detach().numpy(),
                chosen.numpy(),
                None if bias is None else bias.detach().clone().numpy(),
            )

        return hook


def _metrics(per_layer=True, **flags):
    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    return PolicyMetrics(
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=per_layer,
            track_router_health=True,
            log_expert_table=False,
            **flags,
        )
    )


def _train_hf(family, seed, *, per_layer=True, microbatches=((2, 12), (3, 7))):
    model = tiny_model(family, seed=0)
    router = _router_of(family, model.config)
    if family == "deepseek_v3":  # a bias that really moves some choices
        g = torch.Generator().manual_seed(5)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts, generator=g))
    probe = _Probe(model, router)
    metrics = _metrics(per_layer)
    metrics.attach(model, model.config)
    g = torch.Generator().manual_seed(seed)
    with metrics.step():
        for b, s in microbatches:  # two microbatches of different shapes
            ids = torch.randint(0, VOCAB, (b, s), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():  # a no-grad forward after the step is not counted
        model(input_ids=ids)
    out = metrics.finish_step(num_microbatches=len(microbatches))
    metrics.detach()
    return out, probe.layers


@pytest.mark.parametrize("family", FAMILIES)
def test_every_key_matches_the_routers_own_logits_and_choices_hf(family):
    logged, layers = _train_hf(family, seed=1)
    expected = expected_keys({k: v.values() for k, v in layers.items()})
    assert_matches(logged, expected, tokens=2 * 12 + 3 * 7)
    if family == "deepseek_v3":  # sigmoid + bias + groups: the bias moved some choices
        assert 0 < logged["moe/expert_bias_topk_overlap"] < 1
    else:
        assert "moe/expert_bias_topk_overlap" not in logged


def _dp_rank(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        logged, layers = _train_hf(family, seed=10 + rank)
        out[family] = (logged, layers)
    return out


def test_data_parallel_ranks_reduce_to_the_union_of_their_tokens_hf():
    results = ok_values(run_ranks(_dp_rank, 2, timeout=180))
    for family in ("qwen3_moe", "deepseek_v3"):
        merged: dict[int, Layer] = {}
        for res in results:
            for layer, values in res[family][1].items():
                merged.setdefault(layer, Layer()).merge(values)
        expected = expected_keys({k: v.values() for k, v in merged.items()})
        assert results[0][family][0] == results[1][family][0]  # the same dict on every rank
        assert_matches(results[0][family][0], expected, tokens=2 * (2 * 12 + 3 * 7))


def test_without_per_layer_logging_no_layer_key_is_logged():
    logged, layers = _train_hf("deepseek_v3", seed=1, per_layer=False)
    assert not [k for k in logged if k.startswith("moe/layer_")]
    health = {k for k in logged if k in mn.ROUTER_HEALTH_KEYS}
    # The fixed summary set (no rollout routes in this step).
    assert health == set(mn.ROUTER_HEALTH_KEYS) - {mn.ROLLOUT_MAX_OVER_IDEAL}
    assert {mn.MAX_OVER_IDEAL_P50, mn.MAX_OVER_IDEAL_P90, mn.WORST_LAYER} <= set(logged)


class _OpaqueRouter(torch.nn.Module):
    """A router of a family whose score function nobody told us."""

    num_experts, top_k = 4, 1

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)

    def forward(self, x):
        logits = self.proj(x)
        return logits, logits.softmax(-1).amax(-1, keepdim=True), logits.argmax(-1, keepdim=True)


class _Chunk(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.layers = torch.nn.ModuleList([router])

    def forward(self, x):
        return self.layers[0](x)


def test_router_without_a_known_score_function_gets_no_health_keys_and_one_warning():
    from nemo_moe_metrics import attach_collector, register_router

    register_router(
        _OpaqueRouter,
        lambda m, a, k, out: (torch.zeros(4, dtype=torch.int64).scatter_add_(
            0, out[2].reshape(-1), torch.ones(out[2].numel(), dtype=torch.int64)), out[0].shape[0]),
    )  # fmt: skip
    chunk = _Chunk(_OpaqueRouter())
    collector = attach_collector(chunk)
    with pytest.warns(RuntimeWarning, match="no moe/...router_\\* keys .*_OpaqueRouter|layers.0"):
        tracker = enable_health(collector, NEAR_TIE_GAP)
    x = torch.randn(5, 6)
    chunk(x)
    counts = np.bincount(chunk.layers[0](x)[2].reshape(-1).numpy(), minlength=4)
    sums, peaks = (t.numpy() for t in tracker.local_stats())
    out = router_health_metrics([0], sums, peaks, topks=[1], per_layer=True)
    # Never made-up numbers: only the micro-batch balance, which needs no score function.
    assert out == {
        "moe/max_over_ideal_microbatch": counts.max() * 4 / counts.sum(),
        "moe/layer_0/max_over_ideal_microbatch": counts.max() * 4 / counts.sum(),
    }


# -- the arithmetic alone, against the oracle ---------------------------------------------------


def _random_case(seed, r: Router, bias_scale=0.0, tokens=64):
    g = np.random.default_rng(seed)
    z = g.normal(0, 2, (tokens, r.num_experts)).astype(np.float32)
    bias = (bias_scale * g.normal(size=r.num_experts)).astype(np.float32) if bias_scale else None
    valid = g.random(tokens) > 0.2
    return z, bias, valid


def _chosen(z, bias, r: Router):
    """The router's choice, computed the way the router code does (torch, as a router would)."""
    zt = torch.from_numpy(z)
    base = zt.softmax(-1) if r.score == "softmax" else zt.sigmoid()
    s = base if bias is None else (zt if r.bias_on_logits else base) + torch.from_numpy(bias)
    rank = zt if (r.rank_on_logits and bias is None) else s
    if r.groups:
        t = rank.shape[0]
        gs = rank.view(t, r.groups, -1).topk(r.group_k, -1).values.sum(-1)
        keep = torch.zeros(t, r.groups, dtype=torch.bool).scatter_(
            1, gs.topk(r.group_topk, -1).indices, True
        )
        rank = rank.masked_fill(~keep.repeat_interleave(r.num_experts // r.groups, 1), r.masked)
    idx = rank.topk(r.topk, -1).indices
    return torch.zeros_like(zt, dtype=torch.bool).scatter_(1, idx, True).numpy()


@pytest.mark.parametrize(
    "router,bias_scale",
    [
        (Router("softmax", 8, 2), 0.0),
        (Router("sigmoid", 8, 2), 0.0),
        (Router("sigmoid", 16, 4), 0.3),
        (Router("sigmoid", 16, 4, groups=4, group_topk=2, group_k=2), 0.3),
        (Router("softmax", 16, 4, groups=4, group_topk=2, group_k=2, rank_on_logits=True), 0.0),
        (Router("softmax", 16, 4, groups=4, group_topk=2, group_k=2), 0.0),
        (Router("sigmoid", 8, 2, rank_on_logits=True, bias_on_logits=True), 0.8),
        (Router("softmax", 16, 4, groups=4, group_topk=1, group_k=1, masked=0.0), 0.0),
        (Router("sigmoid", 16, 4, groups=4, group_topk=1, group_k=2, masked=0.0), 0.3),
    ],
    ids=[
        "softmax",
        "sigmoid",
        "sigmoid_bias",
        "sigmoid_bias_groups",
        "logit_groups",
        "groups",
        "bias_on_logits",
        "groups_fill_0",
        "sigmoid_bias_groups_fill_0",
    ],
)
def test_decision_sums_match_the_oracle(router, bias_scale):
    z, bias, valid = _random_case(3, router, bias_scale)
    if math.isfinite(router.masked) and bias is not None:
        bias[:: router.num_experts // router.groups] -= 2.0  # one expert per group scores < 0
    chosen = _chosen(z, bias, router)
    oracle = Layer()
    oracle.add(router, z, chosen, bias, valid)
    scoring = RouterScoring(
        router.score, router.num_experts, router.topk, router.rank_on_logits,
        router.groups, router.group_topk, router.group_k, router.bias_on_logits, router.masked,
    )  # fmt: skip
    bias_t = None if bias is None else torch.from_numpy(bias)
    ours = chosen_experts(torch.from_numpy(z), scoring, bias_t).numpy()
    assert (np.take_along_axis(chosen, ours, 1)).all()  # the router's own experts
    if math.isfinite(router.masked) and bias_scale:
        # biased scores below the fill: some tokens route to an expert of a group not kept
        strict = _chosen(z, bias, dataclasses.replace(router, masked=-math.inf))
        assert (strict != chosen).any()
    sums, peak = decision_sums(
        torch.from_numpy(z),
        scoring,
        near_tie_gap=NEAR_TIE_GAP,
        bias=None if bias is None else torch.from_numpy(bias),
        valid=torch.from_numpy(valid),
    )
    counts = torch.from_numpy(chosen[valid].sum(0))
    from nemo_moe_metrics.moe.router_health import microbatch_balance

    row = torch.cat([sums, microbatch_balance(counts)]).numpy()
    out = router_health_metrics(
        [3],
        row[None],
        peak.reshape(1).numpy(),
        topks=[router.topk],
        per_layer=True,
    )
    assert_matches(out, expected_keys({3: oracle.values()}), tokens=int(valid.sum()))
    if bias_scale:
        assert out["moe/expert_bias_topk_overlap"] < 1  # the bias changed some choices


def test_summaries_leave_out_what_no_layer_measured():
    from nemo_moe_metrics.moe import router_health as rh

    sums = np.zeros((2, rh.SLOTS))
    sums[0, [rh.MICRO_RATIO, rh.MICRO_FORWARDS]] = [3.0, 2.0]
    out = router_health_metrics([4, 7], sums, np.zeros(2), topks=[2, 2], per_layer=False)
    assert out == {"moe/max_over_ideal_microbatch": 1.5}


def test_max_over_ideal_percentiles_and_worst_layer_use_numpy_percentiles():
    from nemo_moe_metrics.moe.balance import ExpertLoads, expert_load_metrics

    counts = np.array([[4, 4, 4, 4], [10, 2, 2, 2], [0, 0, 0, 0], [7, 3, 3, 3], [1, 1, 1, 13]])
    loads = ExpertLoads([1, 3, 5, 6, 9], counts, counts.sum(1) // 2, topk=2)
    out = expert_load_metrics(loads, per_layer=False, table=False)
    ratios = [1.0, 2.5, 1.75, 3.25]  # layer 5 routed nothing: left out
    assert out["moe/max_over_ideal_p50"] == np.percentile(ratios, 50)
    assert out["moe/max_over_ideal_p90"] == np.percentile(ratios, 90)
    assert out["moe/worst_layer"] == 9


def test_config_needs_track_moe_metrics_for_router_health():
    from nemo_moe_metrics.config import MetricsConfig

    with pytest.raises(ValueError, match="track_router_health: true needs track_moe_metrics"):
        MetricsConfig(track_router_health=True)
    with pytest.raises(ValueError):
        MetricsConfig(track_moe_metrics=True, track_router_health=True, router_near_tie_gap=0)


# -- torchtitan -----------------------------------------------------------------------------------


def test_torchtitan_sigmoid_bias_router_keys_match_its_gate_logits():
    pytest.importorskip("torchtitan", reason="needs the torchtitan extra (torchtitan 0.3.0)")
    from nemo_moe_metrics.integrations.torchtitan import (
        build_model,
        tiny_config,
        use_sdpa_attention,
    )

    config = use_sdpa_attention(tiny_config("deepseek_v3"))
    model = build_model(config, seed=0)
    layers: dict[int, Layer] = {}
    for name, m in model.named_modules():
        if type(m).__name__ != "TokenChoiceTopKRouter":
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        r = Router(m.score_func, m.num_experts, m.top_k, m.num_expert_groups, m.num_limited_groups)
        seen = {}
        m.gate.register_forward_hook(lambda mod, a, out, seen=seen: seen.update(z=out.detach()))

        def hook(mod, args, out, layer=layer, r=r, seen=seen):
            ids = out[1].reshape(-1, r.topk)
            chosen = torch.zeros(ids.shape[0], r.num_experts, dtype=torch.bool)
            chosen.scatter_(1, ids, True)
            bias = args[1] if len(args) > 1 else None
            layers.setdefault(layer, Layer()).add(
                r,
                seen["z"].numpy(),
                chosen.numpy(),
                None if bias is None else bias.detach().clone().numpy(),
            )

        m.register_forward_hook(hook)
    for m in model.modules():  # a bias that moves some choices
        if getattr(m, "expert_bias_E", None) is not None:
            m.expert_bias_E.copy_(0.05 * torch.randn(m.expert_bias_E.shape))
    metrics = _metrics()
    metrics.attach(model, config)
    g = torch.Generator().manual_seed(0)
    with metrics.step():
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=g)
        model(tokens).float().mean().backward()
    logged = metrics.finish_step(num_microbatches=1)
    assert layers, "no torchtitan router ran"
    assert_matches(logged, expected_keys({k: v.values() for k, v in layers.items()}), tokens=32)
    assert "moe/expert_bias_topk_overlap" in logged


def test_health_warning_names_nothing_for_known_routers():
    model = tiny_model("qwen3_moe")
    metrics = _metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        metrics.attach(model, model.config)
    metrics.detach()


def test_a_router_naming_its_score_function_is_read_and_bad_groups_are_skipped():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from nemo_moe_metrics import attach_collector
    from nemo_moe_metrics.adapters.hf_health import hf_health
    from nemo_moe_metrics.moe import router_health as rh

    class NamedSigmoid(Qwen3MoeTopKRouter):  # a generic family telling its score function
        score_function = "sigmoid"

    class OddGroups(NamedSigmoid):
        n_group, topk_group = 3, 1  # 8 experts do not split into 3 groups

    from tests.moe.test_collector import MoEBlock

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2)
    assert hf_health(NamedSigmoid(cfg), None).scoring.score_function == "sigmoid"
    router = OddGroups(cfg)
    router.config = cfg
    chunk = _Chunk(MoEBlock(router))
    collector = attach_collector(chunk)
    with pytest.warns(RuntimeWarning, match="the groups must divide the experts"):
        tracker = enable_health(collector, NEAR_TIE_GAP)
    chunk(torch.randn(5, 16))
    sums, _ = tracker.local_stats()
    # No decision judged (never a guess), the microbatch balance still measured.
    assert sums[0, rh.TOKENS] == 0 and sums[0, rh.MICRO_FORWARDS] == 1


def test_a_transformers_router_whose_routing_is_not_described_is_not_judged():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from nemo_moe_metrics.adapters.hf_health import hf_health

    class NewFamilyRouter(Qwen3MoeTopKRouter):  # a family the table has not read
        pass

    class GeluScored(Qwen3MoeTopKRouter):
        def __init__(self, config):
            super().__init__(config)
            self.score_fn = torch.nn.GELU()

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2)
    assert "routing of NewFamilyRouter" in hf_health(NewFamilyRouter(cfg), None)
    assert "score function of GeluScored routers is not known ('GELU'" in hf_health(
        GeluScored(cfg), None
    )


@pytest.mark.parametrize(
    "score,biased", [("sigmoid", True), ("softmax", False), ("sqrtsoftplus", True)]
)
def test_the_routers_own_map_judges_as_ranking_the_scores_does(score, biased):
    # Megatron's routing map and a transformers experts call's ids (HealthSource.chosen)
    # replace the pass's own top-k: the same table, padded rows included; the map's expert ids
    # (the accelerator path) are the top-k's.
    gen = torch.Generator().manual_seed(3)
    scoring = RouterScoring(score, 16, 3, rank_on_logits=score == "softmax")
    z = torch.randn(500, 16, generator=gen)
    bias = (torch.randn(16, generator=gen) * 0.3).expand(500, 16) if biased else None
    weight = (torch.rand(500, generator=gen) > 0.25).float()
    top = chosen_experts(z, scoring, None if bias is None else bias[0])
    chosen = torch.zeros(500, 16, dtype=torch.bool).scatter_(1, top, True)
    ranked, slots, magnitude = decision_table(z, scoring, NEAR_TIE_GAP, bias, weight, True)
    mapped, slots_map, magnitude_map = decision_table(
        z, scoring, NEAR_TIE_GAP, bias, weight, True, chosen=chosen
    )
    assert slots_map == slots and torch.equal(magnitude_map, magnitude)
    torch.testing.assert_close(mapped, ranked, rtol=1e-6, atol=1e-6)
    assert torch.equal(chosen_ids(chosen, 3), top.sort(dim=-1).values)
    # The ids in the router's own order (not the top-k's): a permutation per row
    shuffled = top.gather(1, torch.rand(500, 3, generator=gen).argsort(dim=1))
    by_ids, slots_ids, magnitude_ids = decision_table(
        z, scoring, NEAR_TIE_GAP, bias, weight, True, chosen=shuffled
    )
    assert slots_ids == slots and torch.equal(magnitude_ids, magnitude)
    torch.testing.assert_close(by_ids, ranked, rtol=1e-6, atol=1e-6)
