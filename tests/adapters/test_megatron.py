"""Expert-load counting on a real megatron-core GPTModel (CPU, gloo): 1 rank, EP=2 and PP=2.

Expected counts come from the experts' own dispatch: a pre-hook on each layer's SequentialMLP
records ``tokens_per_expert`` (tokens the dispatcher actually hands to the local experts, from
every EP rank with the allgather dispatcher), or from the routing map with padding removed in
numpy. One spawn per world size runs several checks.
"""

from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
BATCH = 2


def _build(ep_size, recompute=None, capacity=None, pipeline=1):
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.megatron.model import build_gpt_model, init_distributed

    overrides = [
        f"policy.megatron_cfg.expert_model_parallel_size={ep_size}",
        f"policy.megatron_cfg.pipeline_model_parallel_size={pipeline}",
    ]
    if recompute:
        overrides.append(f"policy.megatron_cfg.recompute_granularity={recompute}")
    if capacity:
        overrides.append(f"policy.model.moe_expert_capacity_factor={capacity}")
    recipe = load_recipe(RECIPE, overrides)
    init_distributed(recipe.policy.megatron_cfg)
    return build_gpt_model(recipe.policy.model, recipe.policy.megatron_cfg), recipe.policy.model


def _dispatch_probe(model):
    """Records each MoE layer's tokens_per_expert (local experts) at every experts forward."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    seen = {}

    def make(layer):
        def pre(module, args):
            seen.setdefault(layer, []).append(np.asarray(args[1].tolist(), dtype=np.int64))

        return pre

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, SequentialMLP):
            layer = int(name.split("layers.")[1].split(".")[0])  # stage-local index
            handles.append(m.register_forward_pre_hook(make(layer)))
    return seen, handles


def _step(model, model_cfg, seed, padding_mask=None):
    import torch

    from nemo_moe_metrics.megatron.model import causal_attention_mask

    s = model_cfg.seq_length
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, s), generator=g)
    pos = torch.arange(s).expand(BATCH, s)
    kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
    loss = model(tokens, pos, causal_attention_mask(s), labels=tokens, **kwargs).mean()
    if torch.is_grad_enabled():
        loss.backward()


def _single_rank(rank, world_size):
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_moe_metrics import attach_collector

    model, cfg = _build(1)
    s, out = cfg.seq_length, {}
    collector = attach_collector(model)
    out["layer_ids"] = collector.layer_ids

    # Two training microbatches; expected = the experts' dispatched tokens.
    seen, probes = _dispatch_probe(model)
    for mb in range(2):
        _step(model, cfg, seed=mb)
    loads = collector.export()
    out["counts"], out["routed"] = loads.counts.tolist(), loads.routed_tokens.tolist()
    out["dispatched"] = {k: np.sum(v, axis=0).tolist() for k, v in seen.items()}
    for h in probes:
        h.remove()

    # Eval and no_grad forwards add nothing.
    model.eval()
    _step(model, cfg, seed=5)
    model.train()
    with torch.no_grad():
        _step(model, cfg, seed=6)
    out["after_eval"] = collector.export().counts.tolist()

    # Padding (True = padding in megatron's code): only real tokens count.
    maps = {}

    def grab(module, args, kwargs, output):
        maps.setdefault(module.layer_number - 1, []).append(output[1].clone())

    grabs = [
        m.register_forward_hook(grab, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    pad = torch.zeros(BATCH, s, dtype=torch.bool)
    pad[0, 20:] = True
    pad[1, 9:] = True
    _step(model, cfg, seed=7, padding_mask=pad)
    loads = collector.export()
    valid = (~pad).transpose(0, 1).reshape(-1).numpy()  # routing rows are [s, b] flattened
    out["pad_counts"] = loads.counts.tolist()
    out["pad_routed"] = loads.routed_tokens.tolist()
    out["pad_expected"] = [maps[k][0].numpy()[valid].sum(axis=0).tolist() for k in loads.layer_ids]
    out["pad_valid"] = int(valid.sum())
    for h in grabs:
        h.remove()

    # The megatron router's hook path (with a padding mask) makes no host sync.
    from tests.moe.test_collector import Chunk, no_host_sync

    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    wrapped = Chunk(router)
    probe = attach_collector(wrapped)
    x = torch.randn(s, BATCH, cfg.hidden_size)
    with no_host_sync():
        router_map = wrapped(x, padding_mask=pad.transpose(0, 1))[1]
    probe_loads = probe.export()
    probe.detach()
    out["nosync_counts"] = probe_loads.counts.tolist()
    out["nosync_routed"] = probe_loads.routed_tokens.tolist()
    out["nosync_expected"] = router_map.numpy()[valid].sum(axis=0).tolist()
    out["nosync_layer"] = probe_loads.layer_ids

    # Recompute (full, reentrant checkpoint) vs none on identical weights and tokens.
    reference = collector
    for mb in range(2):
        _step(model, cfg, seed=10 + mb)
    out["plain"] = reference.export().counts.tolist()
    reference.detach()
    state = model.state_dict()
    recomputed, _ = _build(1, recompute="full")
    recomputed.load_state_dict(state)
    out["recompute_layers"] = recomputed.config.recompute_granularity
    collector = attach_collector(recomputed)
    calls = []
    raw = [
        m.register_forward_hook(lambda *a: calls.append(1))
        for m in recomputed.modules()
        if isinstance(m, TopKRouter)
    ]
    for mb in range(2):
        _step(recomputed, cfg, seed=10 + mb)
    out["recomputed"] = collector.export().counts.tolist()
    out["raw_router_calls"] = len(calls)
    for h in raw:
        h.remove()
    collector.detach()

    # A capacity factor drops assignments: counts follow the dispatch, not the top-k choice.
    dropping, _ = _build(1, capacity=0.5)
    collector = attach_collector(dropping)
    seen, _ = _dispatch_probe(dropping)
    _step(dropping, cfg, seed=20)
    loads = collector.export()
    out["drop_counts"] = loads.counts.tolist()
    out["drop_dispatched"] = [np.sum(seen[k], axis=0).tolist() for k in (1, 2, 3)]
    out["drop_routed"] = loads.routed_tokens.tolist()
    return out


@pytest.fixture(scope="module")
def single():
    (result,) = ok_values(run_ranks(_single_rank, 1, timeout=150))
    return result


def test_layer_ids_are_global_zero_based_moe_layers(single):
    assert single["layer_ids"] == [1, 2, 3]  # moe_layer_freq [0, 1, 1, 1]


def test_counts_equal_experts_dispatched_tokens(single):
    assert single["counts"] == [single["dispatched"][k] for k in (1, 2, 3)]


def test_counts_sum_to_tokens_times_topk(single):
    tokens = 2 * BATCH * 32
    assert single["routed"] == [tokens] * 3
    assert [sum(row) for row in single["counts"]] == [tokens * 2] * 3


def test_eval_and_no_grad_forwards_add_nothing(single):
    assert single["after_eval"] == [[0] * 8] * 3


def test_padding_tokens_are_not_counted(single):
    assert single["pad_valid"] == 20 + 9
    assert single["pad_routed"] == [29] * 3
    assert single["pad_counts"] == single["pad_expected"]
    assert [sum(r) for r in single["pad_counts"]] == [29 * 2] * 3


def test_megatron_router_hook_makes_no_host_sync(single):
    assert single["nosync_layer"] == [1]
    assert single["nosync_counts"] == [single["nosync_expected"]]
    assert single["nosync_routed"] == [29]


def test_full_recompute_counts_equal_no_recompute(single):
    assert single["recompute_layers"] == "full"
    # The trap is real: each router ran twice per microbatch (forward + replay in backward).
    assert single["raw_router_calls"] == 3 * 2 * 2
    assert single["recomputed"] == single["plain"]
    assert [sum(r) for r in single["recomputed"]] == [2 * BATCH * 32 * 2] * 3


def test_capacity_dropped_assignments_are_not_counted(single):
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.moe.balance import ExpertLoads, expert_load_metrics

    assert single["drop_counts"] == single["drop_dispatched"]
    tokens = BATCH * 32
    assert single["drop_routed"] == [tokens] * 3
    # Capacity per expert = 0.5 * tokens * topk / experts = 8: at most 8 per expert survive.
    assert all(max(row) <= 8 for row in single["drop_counts"])
    kept = sum(sum(row) for row in single["drop_counts"])
    assert kept < 3 * tokens * 2
    loads = ExpertLoads([1, 2, 3], np.array(single["drop_counts"]), np.array([tokens] * 3), 2)
    metrics = expert_load_metrics(loads, per_layer=False, table=False)
    assert metrics[mn.DROPPED_FRACTION] == pytest.approx(1 - kept / (3 * tokens * 2))


def _pipeline_step(model, model_cfg, seed):
    """Two microbatches through megatron-core's own pipeline schedule (1F1B)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import causal_attention_mask

    s = model_cfg.seq_length
    g = torch.Generator().manual_seed(seed)
    batches = iter(
        [torch.randint(0, model_cfg.vocab_size, (BATCH, s), generator=g) for _ in range(2)]
    )
    pos = torch.arange(s).expand(BATCH, s)

    def forward_step(data, model):
        tokens = next(data)
        out = model(tokens, pos, causal_attention_mask(s), labels=tokens)
        return out, lambda o: (o.mean(), {})

    with cpu_device_mode():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=[model],
            num_microbatches=2, seq_length=s, micro_batch_size=BATCH, forward_only=False,
        )  # fmt: skip


def _two_rank_layouts(rank, world_size):
    from nemo_moe_metrics import attach_collector

    out = {}
    # Expert parallel 2: each rank routes its own tokens over all 8 experts, owns 4.
    model, cfg = _build(2)
    collector = attach_collector(model)
    seen, _ = _dispatch_probe(model)
    for mb in range(2):
        _step(model, cfg, seed=100 * rank + mb)
    loads = collector.export()
    out["ep"] = {
        "counts": loads.counts.tolist(),
        "routed": loads.routed_tokens.tolist(),
        "local_dispatched": {k: np.sum(v, axis=0).tolist() for k, v in seen.items()},
    }

    # A padded step (True = padding): megatron still dispatches the padding tokens.
    import torch

    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.moe.balance import expert_load_metrics

    for k in seen:
        seen[k].clear()
    pad = torch.zeros(BATCH, cfg.seq_length, dtype=torch.bool)
    pad[0, 5 + 7 * rank :] = True
    pad[1, 11 + 3 * rank :] = True
    _step(model, cfg, seed=300 + rank, padding_mask=pad)
    loads = collector.export()
    metrics = expert_load_metrics(loads, per_layer=True, table=True, ep_size=2)
    out["pad"] = {
        "counts": loads.counts.tolist(),
        "executed": loads.executed.tolist(),
        "routed": loads.routed_tokens.tolist(),
        "valid": int((~pad).sum()),
        "local_dispatched": {k: np.sum(v, axis=0).tolist() for k, v in seen.items()},
        "metrics": {k: v for k, v in metrics.items() if k != mn.EXPERT_LOADS},
        "table": metrics[mn.EXPERT_LOADS],
    }
    collector.detach()
    out["overload"] = _overload_step(model, cfg, seen, rank)

    # Pipeline parallel 2 (same processes, new layout): stage 0 holds layers 0-1, stage 1 2-3.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # Megatron keeps this scale in a class attribute; the direct calls above left a 0-d one
    # that the schedule cannot copy its [1] scale into.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    model, cfg = _build(1, pipeline=2)
    collector = attach_collector(model)
    seen, _ = _dispatch_probe(model)  # keyed by stage-local layer index
    _pipeline_step(model, cfg, seed=0)
    loads = collector.export()
    out["pp"] = {
        "local_ids": collector.layer_ids,
        "layer_ids": loads.layer_ids,
        "counts": loads.counts.tolist(),
        "local_dispatched": {k + 2 * rank: np.sum(v, axis=0).tolist() for k, v in seen.items()},
    }
    return out


def _overload_step(model, cfg, seen, rank):
    """One PolicyMetrics step of 2 microbatches (forward, backward, forward, backward) under
    EP 2, one of them padded; megatron's own dispatch of each microbatch to this rank's experts
    (the probe) is the oracle."""
    import torch

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True))
    metrics.attach(model, model.config)
    for k in seen:
        seen[k].clear()
    pad = torch.zeros(BATCH, cfg.seq_length, dtype=torch.bool)
    pad[1, 9 + 4 * rank :] = True
    with metrics.step():
        for mb in range(2):
            metrics.microbatch(seq_lens=torch.full((BATCH,), cfg.seq_length))
            _step(model, cfg, seed=500 + 10 * rank + mb, padding_mask=pad if mb else None)
    out = metrics.finish_step(num_microbatches=2)
    metrics.detach()
    return {
        "metrics": {k: v for k, v in out.items() if "overload" in k},
        "ep_imbalance": {la: out[mn.layer_stat_key(la, "ep_imbalance")] for la in (1, 2, 3)},
        "received": {la: [int(x.sum()) for x in seen[la]] for la in (1, 2, 3)},
    }


@pytest.fixture(scope="module")
def two_ranks():
    return ok_values(run_ranks(_two_rank_layouts, 2, timeout=200))


@pytest.mark.timeout(240)
def test_expert_parallel_two_ranks_reduced_counts_equal_owners_dispatch(two_ranks):
    r0, r1 = two_ranks[0]["ep"], two_ranks[1]["ep"]
    assert r0["counts"] == r1["counts"], "export must be identical on every rank"
    # Rank r owns experts [4r, 4r+4); with the allgather dispatcher its local experts receive
    # tokens from both ranks, so the owner's dispatch is the global count of its experts.
    expected = [r0["local_dispatched"][k] + r1["local_dispatched"][k] for k in (1, 2, 3)]
    assert r0["counts"] == expected
    tokens = 2 * 2 * BATCH * 32  # 2 ranks x 2 microbatches
    assert r0["routed"] == [tokens] * 3
    assert [sum(r) for r in r0["counts"]] == [tokens * 2] * 3


def _padded_owner_dispatch(two_ranks):
    """Each layer's global tokens_per_expert: EP rank r's experts' own counts, concatenated."""
    p0, p1 = two_ranks[0]["pad"], two_ranks[1]["pad"]
    return [p0["local_dispatched"][k] + p1["local_dispatched"][k] for k in (1, 2, 3)]


@pytest.mark.timeout(240)
def test_executed_counts_equal_experts_tokens_per_expert_with_padding(two_ranks):
    p0, p1 = two_ranks[0]["pad"], two_ranks[1]["pad"]
    assert p0["executed"] == p1["executed"]
    dispatched = _padded_owner_dispatch(two_ranks)
    assert p0["executed"] == dispatched
    # Every token, padding included, is executed top-k times (no capacity factor).
    assert [sum(r) for r in p0["executed"]] == [2 * BATCH * 32 * 2] * 3


@pytest.mark.timeout(240)
def test_routed_counts_exclude_padding_and_fill_the_table(two_ranks):
    p0 = two_ranks[0]["pad"]
    valid = two_ranks[0]["pad"]["valid"] + two_ranks[1]["pad"]["valid"]
    assert valid < 2 * BATCH * 32  # the step really was padded
    assert p0["routed"] == [valid] * 3
    assert [sum(r) for r in p0["counts"]] == [valid * 2] * 3
    assert all(
        r <= x
        for rc, rx in zip(p0["counts"], p0["executed"], strict=True)
        for r, x in zip(rc, rx, strict=True)
    )
    table = {(row[0], row[1]): row[2] for row in p0["table"]}
    assert [[table[(k, e)] for e in range(8)] for k in (1, 2, 3)] == p0["counts"]


@pytest.mark.timeout(240)
def test_ep_imbalance_is_computed_from_the_experts_executed_work(two_ranks):
    from nemo_moe_metrics.export import metric_names as mn

    metrics = two_ranks[0]["pad"]["metrics"]
    assert metrics == two_ranks[1]["pad"]["metrics"]
    expected = []
    for layer, row in zip((1, 2, 3), _padded_owner_dispatch(two_ranks), strict=True):
        per_rank = [sum(row[:4]), sum(row[4:])]  # what each EP rank's experts computed
        value = max(per_rank) / (sum(per_rank) / 2)
        expected.append(value)
        assert metrics[mn.layer_stat_key(layer, "ep_imbalance")] == pytest.approx(value, rel=1e-12)
    assert metrics[mn.EP_IMBALANCE] == pytest.approx(sum(expected) / 3, rel=1e-12)
    assert metrics[mn.EP_IMBALANCE_MAX] == pytest.approx(max(expected), rel=1e-12)
    # The padding changes the answer: the routed (non-padding) counts give other values.
    routed = [max(sum(r[:4]), sum(r[4:])) / (sum(r) / 2) for r in two_ranks[0]["pad"]["counts"]]
    assert any(abs(a - b) > 1e-3 for a, b in zip(routed, expected, strict=True))


@pytest.mark.timeout(240)
def test_padding_fraction_is_the_padding_share_of_executed_assignments(two_ranks):
    from nemo_moe_metrics.export import metric_names as mn

    p0 = two_ranks[0]["pad"]
    valid = p0["valid"] + two_ranks[1]["pad"]["valid"]
    total = 2 * BATCH * 32
    assert p0["metrics"][mn.PADDING_FRACTION] == pytest.approx(1 - valid / total, rel=1e-12)


def test_pipeline_stages_use_global_layer_ids_and_meet_in_a_union(two_ranks):
    p0, p1 = two_ranks[0]["pp"], two_ranks[1]["pp"]
    assert p0["local_ids"] == [1] and p1["local_ids"] == [2, 3]
    assert p0["layer_ids"] == p1["layer_ids"] == [1, 2, 3]
    assert p0["counts"] == p1["counts"]
    dispatched = {**p0["local_dispatched"], **p1["local_dispatched"]}
    assert p0["counts"] == [dispatched[k] for k in (1, 2, 3)]
    assert [sum(r) for r in p0["counts"]] == [2 * BATCH * 32 * 2] * 3


def _data_times_expert(rank, world_size):
    from megatron.core import parallel_state

    from nemo_moe_metrics import attach_collector

    model, cfg = _build(2)  # 4 ranks: expert parallel 2 x data parallel 2
    collector = attach_collector(model)
    seen, _ = _dispatch_probe(model)
    _step(model, cfg, seed=100 * rank)
    loads = collector.export()
    return {
        "counts": loads.counts.tolist(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "local_dispatched": {k: np.sum(v, axis=0).tolist() for k, v in seen.items()},
    }


@pytest.mark.timeout(240)
def test_data_times_expert_parallel_four_ranks_sums_every_replica():
    results = ok_values(run_ranks(_data_times_expert, 4, timeout=200))
    assert all(r["counts"] == results[0]["counts"] for r in results)
    assert sorted(r["ep_rank"] for r in results) == [0, 0, 1, 1]
    expected = np.zeros((3, 8), dtype=np.int64)
    for r in results:  # each owner saw its EP group's tokens for its 4 experts
        for i, layer in enumerate((1, 2, 3)):
            expected[i, 4 * r["ep_rank"] : 4 * r["ep_rank"] + 4] += r["local_dispatched"][layer]
    assert results[0]["counts"] == expected.tolist()
    assert expected.sum(axis=1).tolist() == [4 * BATCH * 32 * 2] * 3


@pytest.mark.timeout(240)
def test_overload_factor_equals_megatrons_definitions_from_its_own_dispatch(two_ranks):
    # megatron-core's overload factor (dev branch, log_moe_overload_factor), by hand from what
    # its dispatcher handed each EP rank's experts in each microbatch: per (layer, microbatch)
    # entry max_r tokens(r) / balanced, balanced = (both ranks' rows x top-k) / 2; the mean and
    # max over entries; on each rank the running tokens held (+ forward in layer order, -
    # backward in reverse) over the same for its own rows x top-k, peak over peak, max over ranks.
    from nemo_moe_metrics.export import metric_names as mn

    r0, r1 = two_ranks[0]["overload"], two_ranks[1]["overload"]
    assert r0["metrics"] == r1["metrics"]
    got, layers, k = r0["metrics"], (1, 2, 3), 2
    balanced = BATCH * 32 * k  # each rank routes BATCH x 32 rows (padding too) to top-2
    entries = {
        (la, mb): max(r0["received"][la][mb], r1["received"][la][mb]) / balanced
        for la in layers
        for mb in range(2)
    }
    assert got[mn.AVG_OVERLOAD_FACTOR] == pytest.approx(sum(entries.values()) / 6, rel=1e-9)
    assert got[mn.MAX_OVERLOAD_FACTOR] == pytest.approx(max(entries.values()), rel=1e-9)
    for la in layers:
        mine = [entries[(la, mb)] for mb in range(2)]
        assert got[mn.overload_layer_key("avg", la)] == pytest.approx(sum(mine) / 2, rel=1e-9)
        assert got[mn.overload_layer_key("max", la)] == pytest.approx(max(mine), rel=1e-9)
    cumulative = []
    for rank in (r0, r1):  # the schedule's order: each microbatch's forward, then backward
        held = own = peak_held = peak_own = 0
        for mb in range(2):
            for sign, order in ((1, layers), (-1, layers[::-1])):
                for la in order:
                    held += sign * rank["received"][la][mb]
                    own += sign * balanced
                    peak_held, peak_own = max(peak_held, held), max(peak_own, own)
        cumulative.append(peak_held / peak_own)
    assert got[mn.MAX_CUM_OVERLOAD_FACTOR] == pytest.approx(max(cumulative), rel=1e-9)
    # The per-microbatch view is never below the step's summed view (ep_imbalance): a max of
    # ratios bounds the ratio of the sums.
    for la in layers:
        assert got[mn.overload_layer_key("max", la)] >= r0["ep_imbalance"][la] - 1e-12
    assert got[mn.MAX_OVERLOAD_FACTOR] > 1.0
