"""Hardening on real gloo ranks: the whole export through PolicyMetrics at world sizes 1, 2, 4,
and a rank that fails before the export (the others get a clear error, not a hang).

One spawn per world size runs every check of that size; the failure comes last because it
breaks the process group. Ranks of different data (expert parallel 2 from 2 ranks on) each pass
their own sequence lengths, so the expected sums are computed here from what each rank saw.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from dist import ok_values, run_ranks

from nemo_moe_metrics.export import metric_names as mn

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
TIMEOUT_S = 45.0  # init_distributed's collective timeout for the normal phase
FAIL_TIMEOUT_S = 3.0  # shortened (as Megatron's update_pg_timeout does) for the failure phase
MOE_LAYERS = (1, 2, 3)  # the recipe's moe_layer_freq [0, 1, 1, 1], 0-based global ids
MICROBATCHES, BATCH = 2, 2


def _scenario(rank, world_size, fail):
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    ep = 1 if world_size == 1 else 2
    recipe = load_recipe(
        RECIPE,
        [
            f"policy.megatron_cfg.expert_model_parallel_size={ep}",
            "policy.megatron_cfg.moe_per_layer_logging=true",
        ],
    )
    mcfg, model_cfg = recipe.policy.megatron_cfg, recipe.policy.model
    init_distributed(mcfg, timeout_s=TIMEOUT_S)
    from megatron.core import parallel_state as ps

    cpu = torch.device("cpu")
    groups = [
        dist.group.WORLD,
        ps.get_data_parallel_group(),
        ps.get_expert_model_parallel_group(),
        ps.get_expert_data_parallel_group(),
    ]
    timeouts = [g._get_backend(cpu).options._timeout.total_seconds() for g in groups]

    model = build_gpt_model(model_cfg, mcfg)
    metrics = PolicyMetrics(mcfg.metrics(), vocab_size=model_cfg.vocab_size)
    metrics.attach(model, model.config)
    s = model_cfg.seq_length
    gen = torch.Generator().manual_seed(10 + rank)
    positions = torch.arange(s).expand(BATCH, s)
    seen: list[int] = []

    def step():
        with metrics.step():
            for _ in range(MICROBATCHES):
                tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, s), generator=gen)
                lens = torch.randint(1, s + 1, (BATCH,), generator=gen)
                metrics.microbatch(seq_lens=lens)
                seen.extend(lens.tolist())
                loss = model(tokens, positions, causal_attention_mask(s), labels=tokens)
                loss.mean().backward()

    step()
    out = {
        "timeouts": timeouts,
        "full": metrics.finish_step(num_microbatches=MICROBATCHES),
        "lens": list(seen),
        "local_flops": get_flops_estimator(model.config, vocab_size=model_cfg.vocab_size)(
            torch.tensor(seen)
        ).total,
    }
    with metrics.step():  # a microbatch without sequences: zero tokens everywhere
        metrics.microbatch(seq_lens=torch.zeros(0, dtype=torch.int64))
    out["empty"] = metrics.finish_step(num_microbatches=1)
    if fail is None:
        return out

    ps.update_pg_timeout(timedelta(seconds=FAIL_TIMEOUT_S))  # megatron's groups (after a barrier)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=FAIL_TIMEOUT_S), None)
    step()
    if rank == world_size - 1:
        if fail == "exit":  # the rank's process dies, as under torchrun
            raise RuntimeError("simulated failure before the export")
        try:  # the rank survives (user code caught the error) and never joins the export
            raise RuntimeError("simulated failure before the export")
        except RuntimeError:
            time.sleep(FAIL_TIMEOUT_S * 3)
        return {**out, "skipped_export": True}
    start = time.monotonic()
    try:
        metrics.finish_step(num_microbatches=MICROBATCHES)
    except Exception as err:  # noqa: BLE001 - the error itself is what the test checks
        out["error"] = {
            "type": type(err).__name__,
            "text": str(err),
            "notes": getattr(err, "__notes__", []),
            "seconds": time.monotonic() - start,
        }
    return out


@pytest.fixture(scope="module")
def runs():
    one = run_ranks(_scenario, 1, None, timeout=150)
    ok_values(one)  # the one-rank run has no failure phase: it must simply succeed
    return {
        1: one,
        2: run_ranks(_scenario, 2, "exit", timeout=150),
        4: run_ranks(_scenario, 4, "alive", timeout=200),
    }


def _ok(results):
    """The ranks that returned (the failing rank of the 'exit' run raised instead)."""
    return [v for status, v in results if status == "ok"]


@pytest.mark.timeout(400)
def test_init_distributed_gives_megatron_groups_its_timeout_not_whole_minutes(runs):
    for results in runs.values():
        for r in _ok(results):
            assert r["timeouts"] == [TIMEOUT_S] * 4


@pytest.mark.parametrize("world", [1, 2, 4])
def test_full_export_through_policy_metrics_matches_what_every_rank_saw(runs, world):
    ranks = _ok(runs[world])
    if world == 2:
        # The failing rank raised; its first phase ran like the others' (checked at world 4).
        assert runs[2][1][0] == "error" and "simulated failure" in runs[2][1][1]
    assert len(ranks) == (world - 1 if world == 2 else world)
    full = [r["full"] for r in ranks]
    assert all(f == full[0] for f in full), "every rank returns the same metrics"
    m = full[0]
    s = 32
    all_lens = [n for r in ranks for n in r["lens"]]
    if world == 2:  # the failed rank's lengths did not come back: use the per-rank tokens
        assert m[mn.TOKENS] > sum(all_lens)
    else:
        assert m[mn.TOKENS] == sum(all_lens)
        assert m[mn.ESTIMATED_FLOPS] == pytest.approx(sum(r["local_flops"] for r in ranks))
    # Expert loads: each layer routed every token of every rank to top-2 experts.
    per_layer: dict[int, int] = {}
    for layer, _expert, tokens, _pct in m[mn.EXPERT_LOADS]:
        per_layer[layer] = per_layer.get(layer, 0) + tokens
    assert per_layer == dict.fromkeys(MOE_LAYERS, world * MICROBATCHES * BATCH * s * 2)
    # Aux losses: one value per MoE layer; the aggregate is their mean (not over all 4 layers).
    for name in ("load_balancing_loss", "z_loss"):
        layer_values = [m[mn.aux_loss_layer_key(name, i)] for i in MOE_LAYERS]
        assert mn.aux_loss_layer_key(name, 0) not in m
        assert all(v > 0 and math.isfinite(v) for v in layer_values)
        assert m[mn.aux_loss_key(name)] == pytest.approx(sum(layer_values) / len(MOE_LAYERS))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero_token_step_exports_zeros_and_no_nan(runs, world):
    empty = [r["empty"] for r in _ok(runs[world])]
    assert all(e == empty[0] for e in empty)
    e = empty[0]
    assert e[mn.TOKENS] == 0.0 and e[mn.ESTIMATED_FLOPS] == 0.0
    # No expert received a token: routed_tokens 0 and no balance key, table or aux loss made up.
    assert e[mn.ROUTED_TOKENS] == 0.0
    assert [k for k in e if k.startswith(mn.MOE_PREFIX)] == [mn.ROUTED_TOKENS]
    assert all(math.isfinite(v) for v in e.values())


def test_rank_that_dies_before_the_export_gives_the_others_a_clear_error_fast(runs):
    (survivor,) = _ok(runs[2])
    err = survivor["error"]
    # Usually gloo sees the closed socket at once; if the dying rank is slow to tear down
    # (a loaded machine), the shortened timeout fires first. Either way: an error, not a hang.
    assert err["type"] == "RuntimeError"
    assert "Connection closed by peer" in err["text"] or "Timed out" in err["text"], err["text"]
    assert err["seconds"] < FAIL_TIMEOUT_S * 2
    assert any("another rank failed earlier or skipped finish_step" in n for n in err["notes"])


def test_rank_that_skips_the_export_gives_the_others_a_timeout_error_not_a_hang(runs):
    ranks = _ok(runs[4])
    assert ranks[3].get("skipped_export")
    for r in ranks[:3]:
        err = r["error"]
        # The skipping rank exits after its step; under load its closed socket can reach a
        # waiting rank before that rank's timeout does. Either way: an error, not a hang.
        assert err["type"] == "RuntimeError"
        assert "Timed out" in err["text"] or "Connection closed by peer" in err["text"], err["text"]
        # Each rank waits out at most a couple of shortened collective timeouts.
        assert err["seconds"] < FAIL_TIMEOUT_S * 3, err["seconds"]
        assert any("PolicyMetrics.finish_step failed on rank" in n for n in err["notes"])
