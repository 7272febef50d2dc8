"""Router decision health on a real megatron-core GPTModel (CPU, gloo): 1 rank and EP=2 on 2.

The oracle (``health_oracle``, numpy float64) is independent of the code under test: a forward
pre-hook on every TopKRouter computes its logits as ``x @ W.T`` from the router's input, and a
forward hook takes the routing map the router returned (its choice: no replay, no capacity
factor) and its expert bias at that moment; padding comes from the router's own padding mask.
Router kinds: softmax (with and without pre-softmax, with groups), sigmoid with expert bias, and
group-limited sigmoid with expert bias. One spawn per world size runs every kind; the rollout's
own balance (``moe/rollout_max_over_ideal``) is checked on the first kind.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks
from health_oracle import Layer, Router, assert_matches, expected_keys

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
BATCH, TOPK, EXPERTS = 2, 2, 8

#: kind -> (recipe overrides, TransformerConfig fields, oracle router)
KINDS = {
    "softmax": ([], {}, Router("softmax", EXPERTS, TOPK)),
    "sigmoid_bias": (
        ["policy.model.moe_router_enable_expert_bias=true"],
        {},
        Router("sigmoid", EXPERTS, TOPK),
    ),
    "sigmoid_bias_groups": (
        ["policy.model.moe_router_enable_expert_bias=true"],
        dict(moe_router_num_groups=4, moe_router_group_topk=2),
        Router("sigmoid", EXPERTS, TOPK, groups=4, group_topk=2, group_k=1),
    ),
    "softmax_groups": (
        [],
        dict(moe_router_num_groups=4, moe_router_group_topk=2),
        Router("softmax", EXPERTS, TOPK, groups=4, group_topk=2, group_k=1, rank_on_logits=True),
    ),
    "pre_softmax_groups": (
        [],
        dict(moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2),
        Router("softmax", EXPERTS, TOPK, groups=4, group_topk=2, group_k=1),
    ),
}


def _build(ep_size, overrides, fields):
    import nemo_moe_metrics.megatron.model as mm
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(
        RECIPE, [f"policy.megatron_cfg.expert_model_parallel_size={ep_size}", *overrides]
    )
    mm.init_distributed(recipe.policy.megatron_cfg)
    original = mm.build_transformer_config
    mm.build_transformer_config = lambda *a, **k: dataclasses.replace(original(*a, **k), **fields)
    try:
        return mm.build_gpt_model(recipe.policy.model, recipe.policy.megatron_cfg), recipe
    finally:
        mm.build_transformer_config = original


class _Probe:
    """Per router forward: logits from its input, its routing map, bias and padding."""

    def __init__(self, model, router):
        from megatron.core.transformer.moe.router import TopKRouter

        self.router, self.layers, self._pending = router, {}, {}
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_pre_hook(self._pre(m), with_kwargs=True)
                m.register_forward_hook(self._post(m))

    def _pre(self, module):
        def pre(mod, args, kwargs):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            valid = None if pad is None else (~pad.reshape(-1).bool()).numpy()
            self._pending[id(mod)] = ((x @ mod.weight.detach().double().T).numpy(), valid)

        return pre

    def _post(self, module):
        def post(mod, args, output):
            logits, valid = self._pending.pop(id(mod))
            bias = getattr(mod, "expert_bias", None)
            self.layers.setdefault(mod.layer_number - 1, Layer()).add(
                self.router,
                logits,
                output[1].numpy(),
                None if bias is None else bias.detach().clone().numpy(),
                valid,
            )

        return post


def _run(rank, world_size, kinds):
    import torch

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.megatron.model import causal_attention_mask
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    out = {}
    for kind in kinds:
        overrides, fields, router = KINDS[kind]
        torch.manual_seed(3)
        model, recipe = _build(world_size, overrides, fields)
        for m in model.modules():  # a bias that really moves some choices
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.copy_(0.05 * torch.randn(EXPERTS))
        probe = _Probe(model, router)
        rollout = kind == "softmax"
        metrics = PolicyMetrics(
            MetricsConfig(
                track_moe_metrics=True,
                moe_per_layer_logging=True,
                log_expert_table=False,
                track_router_health=True,
                track_routing_consistency=rollout,
            )
        )
        metrics.attach(model, model.config)
        s = recipe.policy.model.seq_length
        g = torch.Generator().manual_seed(20 + rank)
        rollout_counts = {}
        with metrics.step():
            for mb in range(2):
                tokens = torch.randint(1, 128, (BATCH, s), generator=g)
                lengths = torch.tensor([s - 3 - mb - rank, s - 9])
                pad = torch.arange(s).unsqueeze(0) >= lengths.unsqueeze(1)
                routes = None
                if rollout:  # the engine's routes: [b, s, MoE layers, k], -1 rows left out
                    routes = torch.rand(BATCH, s, 3, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
                    routes[0, 5] = -1
                    routes[pad] = -1
                    for j in range(3):
                        r = routes[:, :, j].reshape(-1, TOPK)
                        r = r[(r >= 0).all(-1)]
                        c = np.bincount(r.reshape(-1).numpy(), minlength=EXPERTS)
                        rollout_counts[j] = rollout_counts.get(j, 0) + c
                metrics.microbatch(seq_lens=lengths, rollout_routes=routes)
                pos = torch.arange(s).expand(BATCH, s)
                # megatron-core 0.16's expert-bias update fails on a padding mask ([T] against
                # the [T, E] map): the bias kinds run without one.
                padding = None if "bias" in kind else pad
                logits = model(tokens, pos, causal_attention_mask(s), padding_mask=padding)
                logits.float().mean().backward()
        out[kind] = {
            "logged": metrics.finish_step(num_microbatches=2),
            "layers": probe.layers,
            "rollout_counts": rollout_counts,
        }
        metrics.detach()
    return out


def _check(results, kinds):
    for kind in kinds:
        merged: dict[int, Layer] = {}
        for res in results:
            assert res[kind]["logged"] == results[0][kind]["logged"]  # same dict on every rank
            for layer, values in res[kind]["layers"].items():
                merged.setdefault(layer, Layer()).merge(values)
        assert sorted(merged) == [1, 2, 3]  # moe_layer_freq [0, 1, 1, 1]
        logged = results[0][kind]["logged"]
        expected = expected_keys({k: v.values() for k, v in merged.items()})
        tokens = min(len(v.confidence) for v in merged.values())
        assert_matches(logged, expected, tokens=tokens)
        if "bias" in kind:
            assert 0 < logged["moe/expert_bias_topk_overlap"] < 1
        if kind == "softmax":
            counts = sum(
                np.stack([r[kind]["rollout_counts"][j] for j in range(3)]) for r in results
            )
            ratios = counts.max(1) * EXPERTS / counts.sum(1)
            for j, layer in enumerate([1, 2, 3]):
                assert logged[f"moe/layer_{layer}/rollout_max_over_ideal"] == pytest.approx(
                    ratios[j]
                )
            assert logged["moe/rollout_max_over_ideal"] == pytest.approx(ratios.mean())


@pytest.mark.parametrize(
    "world_size,kinds",
    [(1, list(KINDS)), (2, ["softmax", "sigmoid_bias_groups"])],
    ids=["one_rank", "ep2"],
)
def test_every_key_matches_the_routers_own_logits_and_choices_megatron(world_size, kinds):
    results = ok_values(run_ranks(_run, world_size, kinds, timeout=300))
    _check(results, kinds)


def test_sinkhorn_router_gets_no_health_keys_and_says_why():
    from nemo_moe_metrics.adapters.megatron import health as megatron_health

    class _Cfg:
        moe_router_load_balancing_type = "sinkhorn"

    class _Router:
        config = _Cfg()
        routing_type = "sinkhorn"

    assert "sinkhorn" in megatron_health(_Router(), None)
