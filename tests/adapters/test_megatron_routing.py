"""Routing consistency on a real megatron-core GPTModel (CPU, gloo): 1 rank and EP=2 on 2 ranks.

The oracle is independent of the code under test: forward pre-hooks on every TopKRouter record
its input, and the test computes the router's own top-k as ``topk(x @ W.T)`` in float64
(softmax is monotone), next to the routing map the router returned (what was executed). The
rollout routes come from a bf16-autocast eval forward recorded by the same hooks. One spawn per
world size runs every check.
"""

from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
BATCH = 2
TOPK = 2


def _build(ep_size, replay):
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.megatron.model import build_gpt_model, init_distributed

    recipe = load_recipe(
        RECIPE,
        [
            f"policy.megatron_cfg.expert_model_parallel_size={ep_size}",
            "algorithm=grpo",
            f"policy.megatron_cfg.moe_enable_routing_replay={str(replay).lower()}",
        ],
    )
    init_distributed(recipe.policy.megatron_cfg)
    return build_gpt_model(recipe.policy.model, recipe.policy.megatron_cfg), recipe.policy.model


class _Oracle:
    """Per router forward: own top-k set from its input, executed routing map."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.own, self.executed, self.handles = {}, {}, []
        for m in model.modules():
            if isinstance(m, TopKRouter):
                self.handles.append(m.register_forward_pre_hook(self._pre(m), with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post(m)))

    def _pre(self, router):
        def pre(module, args, kwargs):
            import torch

            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            logits = x @ router.weight.detach().double().T
            idx = torch.topk(logits, TOPK, dim=1).indices
            self.own.setdefault(router.layer_number - 1, []).append(idx.numpy())

        return pre

    def _post(self, router):
        def post(module, args, output):
            self.executed.setdefault(router.layer_number - 1, []).append(output[1].numpy().copy())

        return post

    def clear(self):
        self.own.clear()
        self.executed.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def _batch(model_cfg, seed, rank):
    import torch

    s = model_cfg.seq_length
    g = torch.Generator().manual_seed(seed * 10 + rank)
    tokens = torch.randint(1, model_cfg.vocab_size, (BATCH, s), generator=g)
    lengths = torch.tensor([s - 5 - rank, s - 11])
    pad = torch.arange(s).unsqueeze(0) >= lengths.unsqueeze(1)
    return tokens, lengths, pad


def _forward(model, model_cfg, tokens, pad, train):
    import torch

    from nemo_moe_metrics.megatron.model import causal_attention_mask

    s = model_cfg.seq_length
    pos = torch.arange(s).expand(tokens.shape[0], s)
    out = model(tokens, pos, causal_attention_mask(s), labels=tokens, padding_mask=pad)
    if train:
        out.float().mean().backward()


def _rollout_routes(model, model_cfg, oracle, tokens, pad):
    """bf16-autocast eval forward: the routes an inference engine returns, [b, s, L, k], -1 pad."""
    import torch

    oracle.clear()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _forward(model, model_cfg, tokens, pad, train=False)
    model.train()
    b, s = tokens.shape
    layers = sorted(oracle.executed)
    per_layer = []
    for layer in layers:
        m = torch.from_numpy(oracle.executed[layer][0])  # [s*b, E], sequence-major
        idx = m.float().topk(TOPK, dim=1).indices.reshape(s, b, TOPK).transpose(0, 1)
        per_layer.append(idx)
    routes = torch.stack(per_layer, dim=2).clone()  # [b, s, L, k]
    routes[pad] = -1
    oracle.clear()
    return routes


def _expected(oracle, routes, pad, use_executed):
    """Integer sums per layer from the oracle, in numpy: [pairs, routed, differ, overlap]."""
    b, s = pad.shape
    valid = ~pad.numpy().T.reshape(-1)  # router order [s*b]
    r = routes.numpy().transpose(1, 0, 2, 3).reshape(s * b, routes.shape[2], TOPK)
    out, any_diff, all_routed = {}, np.zeros(s * b, bool), np.ones(s * b, bool)
    for j, layer in enumerate(sorted(oracle.own)):
        if use_executed:
            chosen = [set(np.flatnonzero(row)) for row in oracle.executed[layer][0]]
        else:
            chosen = [set(row) for row in oracle.own[layer][0]]
        routed = valid & (r[:, j] >= 0).all(axis=1)
        overlap = np.array([len(set(r[t, j]) & chosen[t]) for t in range(s * b)])
        differ = routed & (overlap < TOPK)
        out[layer] = [
            int(valid.sum()),
            int(routed.sum()),
            int(differ.sum()),
            int(overlap[routed].sum()),
        ]
        any_diff |= differ
        all_routed &= routed
    return out, [int(all_routed.sum()), int((any_diff & all_routed).sum())]


def _metrics(per_layer=True):
    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    return PolicyMetrics(
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=per_layer,
            track_routing_consistency=True,
            log_expert_table=False,
        )
    )


def _run(rank, world_size):
    import torch

    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.moe.routing import RoutingShapeError

    out = {}
    torch.manual_seed(7)
    model, cfg = _build(world_size, replay=False)
    oracle = _Oracle(model)
    metrics = _metrics()
    metrics.attach(model, model.config)
    tokens, lengths, pad = _batch(cfg, 1, rank)
    routes = _rollout_routes(model, cfg, oracle, tokens, pad)

    # Replay off: the training router's own choice against the bf16 rollout.
    with metrics.step():
        metrics.microbatch(seq_lens=lengths, rollout_routes=routes)
        _forward(model, cfg, tokens, pad, train=True)
    out["off"] = metrics.finish_step(num_microbatches=1)
    out["off_expected"] = _expected(oracle, routes, pad, use_executed=False)
    oracle.clear()

    # The same routes packed [tokens, L, k] in the router's token order give the same numbers.
    packed = routes.transpose(0, 1).reshape(-1, routes.shape[2], TOPK)
    with metrics.step():
        metrics.microbatch(seq_lens=lengths, rollout_routes=packed)
        _forward(model, cfg, tokens, pad, train=True)
    out["packed"] = metrics.finish_step(num_microbatches=1)
    oracle.clear()

    # No routes at all: every pair is missing.
    with metrics.step():
        metrics.microbatch(seq_lens=lengths)
        _forward(model, cfg, tokens, pad, train=True)
    out["none"] = metrics.finish_step(num_microbatches=1)
    oracle.clear()

    # Shape errors name both shapes and come before any forward or collective.
    errors = []
    with metrics.step():
        for bad in (routes[:, :, :2], routes[:1], routes[..., :1]):
            try:
                metrics.microbatch(seq_lens=lengths, rollout_routes=bad)
            except RoutingShapeError as err:
                errors.append(str(err))
        metrics.microbatch(seq_lens=lengths, rollout_routes=None)
    out["errors"] = errors
    metrics.detach()
    oracle.remove()

    # Replay on: megatron-core's RouterReplay executes the rollout's experts.
    replayed, _ = _build(world_size, replay=True)
    replayed.load_state_dict(model.state_dict())
    oracle = _Oracle(replayed)
    metrics = _metrics()
    metrics.attach(replayed, replayed.config)
    routers = compat.megatron_routers(replayed)
    router_order = routes.transpose(0, 1).reshape(-1, routes.shape[2], TOPK)
    with metrics.step():
        metrics.microbatch(seq_lens=lengths, rollout_routes=routes)
        compat.set_router_replay(routers, [router_order[:, j] for j in range(len(routers))])
        _forward(replayed, cfg, tokens, pad, train=True)
        compat.clear_router_replay(routers)
    out["on"] = metrics.finish_step(num_microbatches=1)
    out["on_expected"] = _expected(oracle, routes, pad, use_executed=False)
    out["on_executed"] = _expected(oracle, routes, pad, use_executed=True)
    valid = ~pad.T.reshape(-1).numpy()
    r = router_order.numpy()
    out["executed_equal"] = all(
        all(
            set(np.flatnonzero(oracle.executed[layer][0][t])) == set(r[t, j])
            for t in np.flatnonzero(valid)
        )
        for j, layer in enumerate(sorted(oracle.executed))
    )
    out["replay_actions_cleared"] = [r.router_replay.router_replay_action for r in routers]
    return out


def _check(results, world_size):
    first = results[0]
    layers = sorted(first["off_expected"][0])
    for case, expected_key in (("off", "off_expected"), ("on", "on_expected")):
        sums = np.zeros((len(layers), 4), dtype=np.int64)
        tokens = np.zeros(2, dtype=np.int64)
        for res in results:
            per_layer, tok = res[expected_key]
            sums += np.array([per_layer[k] for k in layers])
            tokens += np.array(tok)
        m = first[case]
        for res in results:
            assert res[case] == m  # the same dict on every rank
        pairs, routed, differ, overlap = sums.sum(axis=0)
        assert m["moe/routing_disagreement"] == differ / routed
        assert m["moe/routing_topk_overlap"] == overlap / (routed * 2)
        assert m["moe/routing_missing_fraction"] == (pairs - routed) / pairs
        assert m["moe/routing_tokens_any_layer_differs"] == tokens[1] / tokens[0]
        for i, layer in enumerate(layers):
            assert m[f"moe/layer_{layer}/routing_disagreement"] == sums[i, 2] / sums[i, 1]
            assert m[f"moe/layer_{layer}/routing_topk_overlap"] == sums[i, 3] / (sums[i, 1] * 2)
    off, on = first["off"], first["on"]
    assert off["moe/routing_disagreement"] > 0  # bf16 rollout vs fp32 training really differ
    assert "moe/routing_replay_mismatch" not in off
    assert on["moe/routing_replay_mismatch"] == 0.0
    assert on["moe/routing_disagreement"] > 0  # the router's own choice still differs
    for res in results:
        assert res["executed_equal"]
        assert res["replay_actions_cleared"] == [None] * len(layers)
        executed = res["on_executed"][0]
        assert all(executed[k][2] == 0 for k in layers)  # oracle: executed == rollout
    assert first["packed"] == off
    none = first["none"]
    assert none["moe/routing_missing_fraction"] == 1.0
    assert "moe/routing_disagreement" not in none  # no pair with a route: 0/0 is not logged
    errs = first["errors"]
    assert len(errs) == 3
    assert "(2, 32, 2, 2)" in errs[0] and "[tokens, 3, 2]" in errs[0]
    assert "1 sequences" in errs[1] and "2 sequences" in errs[1]
    assert "(2, 32, 3, 1)" in errs[2]


@pytest.mark.parametrize("world_size", [1, 2])
def test_routing_keys_match_independent_router_oracle_megatron(world_size):
    results = ok_values(run_ranks(_run, world_size, timeout=240))
    _check(results, world_size)
