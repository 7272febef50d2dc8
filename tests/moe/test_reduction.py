"""Cross-rank reduction of expert counts on real gloo ranks: sum, union, signature agreement."""

import time

import numpy as np
import pytest
import torch
from dist import ok_values, run_ranks
from torch import nn

from nemo_moe_metrics import attach_collector, register_router
from nemo_moe_metrics.moe.reduction import (
    ExpertLoadReducer,
    ExpertLoadSignatureError,
    LayerSignature,
    Signature,
    check_signatures,
    export_expert_loads,
)

K = 2


class TinyRouter(nn.Module):
    """Top-2 router returning (logits, weights, indices) like the Hugging Face routers."""

    def __init__(self, experts: int):
        super().__init__()
        self.num_experts, self.top_k = experts, K
        self.proj = nn.Linear(4, experts)

    def forward(self, x):
        logits = self.proj(x)
        weights, indices = logits.topk(K, dim=-1)
        return logits, weights, indices


def _counts(module, args, kwargs, out):
    return torch.nn.functional.one_hot(out[2], module.num_experts).sum(dim=(0, 1)), out[2].shape[0]


register_router(TinyRouter, _counts)


class Model(nn.Module):
    """Routers at the given global layer ids (other slots are dense placeholders)."""

    def __init__(self, layers: dict[int, int]):
        super().__init__()
        n = max(layers) + 1 if layers else 1
        self.layers = nn.ModuleList(
            [TinyRouter(layers[i]) if i in layers else nn.Identity() for i in range(n)]
        )

    def forward(self, x):
        for layer in self.layers:
            if isinstance(layer, TinyRouter):
                layer(x)
        return x


def _run(layers, seed, tokens=6):
    """Build, attach, one training forward; return collector and the local counts by numpy."""
    torch.manual_seed(0)  # same weights on every rank
    model = Model(layers).train()
    collector = attach_collector(model)
    x = torch.randn(tokens, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    model(x)
    collector.step = lambda: model(x)  # another identical training forward
    local = {
        i: np.bincount(m(x)[2].reshape(-1).detach().numpy(), minlength=m.num_experts).tolist()
        for i, m in enumerate(model.layers)
        if isinstance(m, TinyRouter)
    }
    return collector, local


def _attempt(fn):
    start = time.monotonic()
    try:
        return ("ok", fn(), time.monotonic() - start)
    except ExpertLoadSignatureError as err:
        return ("error", str(err), time.monotonic() - start)


def _phases(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}

    # Same layers, different tokens: summed.
    collector, local = _run({0: 8, 1: 8}, seed=rank)
    loads = collector.export()
    out["sum"] = (loads.layer_ids, loads.counts.tolist(), loads.routed_tokens.tolist(), local)
    collector.step()
    out["steady"] = collector.export().counts.tolist()  # the cached-layout path
    out["after_reset"] = int(collector.export().counts.sum())

    # Same stage, different layer ids: both ranks raise the same error.
    collector, _ = _run({0: 8, 1: 8} if rank == 0 else {0: 8, 2: 8}, seed=rank)
    out["ids"] = _attempt(lambda: collector.export())

    # One layer id, two expert counts.
    collector, _ = _run({0: 8} if rank == 0 else {0: 4}, seed=rank)
    out["experts"] = _attempt(lambda: collector.export())

    # Pipeline-like: rank 1 has no MoE layer (stage 1) and still gets the full loads, twice.
    collector, local = _run({0: 8, 1: 8}, seed=rank) if rank == 0 else (None, {})
    reducer = ExpertLoadReducer(stage=rank)
    first = export_expert_loads(collector, reducer=reducer)
    second = export_expert_loads(collector, reducer=reducer)
    out["none_rank"] = (first.layer_ids, first.counts.tolist(), int(second.counts.sum()), local)

    # A rank without MoE in the same stage as one with MoE layers: a clear error on both.
    collector, _ = _run({0: 8}, seed=rank) if rank == 0 else (None, {})
    out["none_same_stage"] = _attempt(
        lambda: export_expert_loads(collector, reducer=ExpertLoadReducer(stage=0))
    )

    # Disjoint stages: union by layer id, nothing summed across layers.
    collector, local = _run({0: 8} if rank == 0 else {1: 4}, seed=rank)
    loads = export_expert_loads(collector, reducer=ExpertLoadReducer(stage=rank))
    out["union"] = (loads.layer_ids, loads.num_experts, loads.counts.tolist(), local)

    # Tensor-parallel replica (no sequence parallel): counted once.
    collector, local = _run({0: 8}, seed=0)  # replicas see the same tokens
    out["replica"] = (collector.export(contribute=rank == 0).counts.tolist(), local)

    # A rank re-attaches to other layers after the first export: both ranks raise.
    collector, _ = _run({0: 8}, seed=rank)
    reducer = ExpertLoadReducer()
    reducer.export(collector)
    if rank == 1:
        collector, _ = _run({0: 8, 1: 8}, seed=rank)
    out["changed"] = _attempt(lambda: reducer.export(collector))
    return out


@pytest.fixture(scope="module")
def phases():
    return ok_values(run_ranks(_phases, 2, timeout=60))


def test_same_layers_are_summed_and_identical_on_every_rank(phases):
    r0, r1 = phases[0]["sum"], phases[1]["sum"]
    assert r0[:3] == r1[:3]
    assert r0[0] == [0, 1]
    expected = [(np.array(r0[3][i]) + np.array(r1[3][i])).tolist() for i in (0, 1)]
    assert r0[1] == expected
    assert r0[2] == [12, 12]


def test_later_exports_reuse_the_layout_and_sum_again(phases):
    assert phases[0]["steady"] == phases[1]["steady"] == phases[0]["sum"][1]


def test_export_resets_accumulators(phases):
    assert phases[0]["after_reset"] == 0 and phases[1]["after_reset"] == 0


@pytest.mark.parametrize(
    "phase,needle",
    [
        ("ids", "different MoE layers"),
        ("experts", "layer 0 has 4 experts on ranks [1]; 8 experts on ranks [0]"),
    ],
)
def test_signature_mismatch_raises_same_clear_error_on_both_ranks(phases, phase, needle):
    (s0, m0, t0), (s1, m1, t1) = phases[0][phase], phases[1][phase]
    assert s0 == s1 == "error"
    assert m0 == m1 and needle in m0
    assert max(t0, t1) < 5.0


def test_rank_without_moe_takes_part_and_gets_full_loads(phases):
    ids, counts, second_sum, _ = phases[1]["none_rank"]
    ids0, counts0, _, local0 = phases[0]["none_rank"]
    assert ids == ids0 == [0, 1]
    assert counts == counts0 == [local0[0], local0[1]]
    assert second_sum == 0


def test_rank_without_moe_in_a_stage_with_moe_is_an_error(phases):
    (s0, m0, _), (s1, m1, _) = phases[0]["none_same_stage"], phases[1]["none_same_stage"]
    assert s0 == s1 == "error" and m0 == m1 and "pipeline stage 0" in m0


def test_pipeline_stages_meet_in_a_union_by_layer_id(phases):
    ids, experts, counts, local0 = phases[0]["union"]
    local1 = phases[1]["union"][3]
    assert ids == [0, 1] and experts == [8, 4]
    assert counts == [local0[0], local1[1] + [0] * 4]  # padded with zeros to the widest layer


def test_tensor_parallel_replicas_count_once(phases):
    counts, local = phases[0]["replica"]
    assert counts == [local[0]]
    assert phases[1]["replica"][0] == counts


def test_layers_changed_after_first_export_raise_on_both_ranks(phases):
    (s0, m0, _), (s1, m1, _) = phases[0]["changed"], phases[1]["changed"]
    assert s0 == s1 == "error" and m0 == m1 and "changed their MoE layers" in m0


def test_single_process_export_needs_no_process_group():
    collector, local = _run({0: 8, 3: 8}, seed=0)
    loads = collector.export()
    assert loads.layer_ids == [0, 3] and loads.counts.tolist() == [local[0], local[3]]


def test_none_collector_without_reducer_is_a_clear_error():
    with pytest.raises(TypeError, match="reducer=ExpertLoadReducer"):
        export_expert_loads(None)


def _sig(stage, *layers):
    return Signature(stage, tuple(LayerSignature(*layer) for layer in layers))


def test_check_signatures_rejects_overlapping_stages():
    sigs = [_sig(0, (0, 8, 2), (1, 8, 2)), _sig(1, (1, 8, 2), (2, 8, 2))]
    with pytest.raises(ExpertLoadSignatureError, match=r"stages 0 and 1 both hold layers \[1\]"):
        check_signatures(sigs)


def test_check_signatures_rejects_a_layer_whose_topk_differs_between_ranks():
    sigs = [_sig(0, (0, 8, 2)), _sig(0, (0, 8, 4))]
    with pytest.raises(
        ExpertLoadSignatureError, match=r"8 experts, top-2 on ranks \[0\]; 8 experts, top-4"
    ):
        check_signatures(sigs)


def test_check_signatures_accepts_layers_that_differ_from_each_other():
    layout = check_signatures(
        [_sig(0, (0, 8, 2), (1, 4, 1, True)), _sig(0, (0, 8, 2), (1, 4, 1, True))]
    )
    assert (layout.layer_ids, layout.experts, layout.topks) == ([0, 1], [8, 4], [2, 1])
    assert layout.zero_computation == [False, True]


def test_duplicate_layer_ids_in_chunks_are_rejected():
    model = Model({0: 8})
    with pytest.raises(ValueError, match="both claim global layer 0"):
        attach_collector([model, Model({0: 8})])
