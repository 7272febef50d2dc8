"""Mistakes a user makes with the five PolicyMetrics calls: each is an error (or a warning) that
names the fix, never a number that looks valid.

A tiny Hugging Face Mixtral (2 MoE layers, 8 experts, top-2) and a padding-aware custom router
(registered through the public ``register_router``), single process; the multi-rank behaviour
of the export's checks is in tests/worker/test_policy_metrics_guards.py.
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import VOCAB, tiny_model
from torch import nn

from nemo_moe_metrics import register_router
from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.moe.routing import RoutingShapeError
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

pytestmark = pytest.mark.megatron

BATCH, SEQ = 2, 8
ALL = MetricsConfig(
    track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True, track_flops=True
)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _attached(cfg: MetricsConfig = ALL) -> tuple[PolicyMetrics, nn.Module]:
    model = tiny_model("mixtral")
    metrics = PolicyMetrics(cfg)
    metrics.attach(model, model.config)
    return metrics, model


def _train(model: nn.Module, seed: int = 0) -> None:
    ids = _ids(seed)
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("flags", [ALL, MetricsConfig()], ids=["all flags", "no flag"])
def test_every_call_before_attach_names_attach(flags):
    metrics = PolicyMetrics(flags)
    before = r"step\(\) before attach\(\).*metrics.attach\(model"
    with pytest.raises(RuntimeError, match=before), metrics.step():
        pass
    with pytest.raises(RuntimeError, match=r"finish_step\(\) before attach\(\)"):
        metrics.finish_step(num_microbatches=1)
    with pytest.raises(RuntimeError, match=r"microbatch\(\) before attach\(\)"):
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))


def test_a_forgotten_step_block_raises_instead_of_logging_zero_tokens():
    metrics, model = _attached()
    with pytest.raises(RuntimeError, match=r"microbatch\(\) called outside a step"):
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
    _train(model)  # the forward-backward without `with metrics.step():`
    with pytest.raises(RuntimeError, match=r"finish_step\(\) without a step.*metrics.step\(\)"):
        metrics.finish_step(num_microbatches=1)


def test_finish_step_twice_raises_and_the_next_step_still_counts():
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        _train(model)
    first = metrics.finish_step(num_microbatches=1)
    assert first[mn.TOKENS] == BATCH * SEQ == first[mn.ROUTED_TOKENS]
    with pytest.raises(RuntimeError, match="finish_step called twice"):
        metrics.finish_step(num_microbatches=1)
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([5, 3]))
        _train(model, seed=1)
        with pytest.raises(RuntimeError, match=r"inside `with metrics.step\(\):`"):
            metrics.finish_step(num_microbatches=1)
    assert metrics.finish_step(num_microbatches=1)[mn.TOKENS] == 8


def test_num_microbatches_that_disagrees_with_the_calls_is_refused_before_any_collective():
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        _train(model)
    with pytest.raises(ValueError, match=r"num_microbatches=4\) but microbatch\(\) was called 1"):
        metrics.finish_step(num_microbatches=4)
    # Nothing was exported: the same step exports once the count is right.
    got = metrics.finish_step(num_microbatches=1)
    assert got[mn.TOKENS] == BATCH * SEQ


def test_a_restarted_or_failed_step_forgets_its_microbatch_calls():
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        _train(model)
        metrics.restart_step()  # megatron's rerun machine runs the forward-backward again
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        _train(model)
    assert metrics.finish_step(num_microbatches=1)[mn.TOKENS] == BATCH * SEQ
    with pytest.raises(KeyError), metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        raise KeyError("a failing batch")
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))
        _train(model)
    assert metrics.finish_step(num_microbatches=1)[mn.TOKENS] == BATCH * SEQ


def test_lengths_summing_past_the_batch_are_refused_not_logged():
    """The issue's case: seq_lens adding up to 2,000 tokens for a 2 x 8 batch."""
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([1000, 1000]))
        _train(model)
    with pytest.raises(ValueError, match=r"2,000 tokens but the model inputs .* only 16 token"):
        metrics.finish_step(num_microbatches=1)


@pytest.mark.parametrize("lengths", [[SEQ], [3, 3, 3]], ids=["1 for 2", "3 for 2"])
def test_a_length_count_that_is_not_the_batchs_sequence_count_is_refused(lengths):
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor(lengths))  # sums fit the 16 positions
        _train(model)
    with pytest.raises(ValueError, match=rf"got {len(lengths)} length\(s\) but .* batch of 2 seq"):
        metrics.finish_step(num_microbatches=1)
    # One packed row ([1, total], as THD packing feeds the model) takes one length per sequence.
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([3, 5, 8]))
        ids = _ids().reshape(1, BATCH * SEQ)
        model(input_ids=ids, labels=ids).loss.backward()
    assert metrics.finish_step(num_microbatches=1)[mn.TOKENS] == 16


def test_a_length_near_2_to_the_62_is_a_clear_error_not_an_overflow():
    metrics, model = _attached()
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([2**62, 2**62]))
        _train(model)
    with pytest.raises(ValueError, match=r"4,611,686,018,427,387,904 tokens is over 2,147,483,647"):
        metrics.finish_step(num_microbatches=1)


class PaddingAwareRouter(nn.Module):
    """Top-2 router that, like megatron-core's, is told which tokens are padding."""

    num_experts, top_k = 8, 2

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, self.num_experts)

    def forward(self, hidden, padding_mask):
        return self.proj(hidden).topk(self.top_k, dim=-1).indices


def _real_token_counts(module, args, kwargs, out):
    real = ~args[1].reshape(-1)
    counts = torch.zeros(module.num_experts, dtype=torch.int64)
    counts.scatter_add_(0, out[real].reshape(-1), torch.ones_like(out[real].reshape(-1)))
    return counts, real.sum()


register_router(PaddingAwareRouter, _real_token_counts)


class PaddedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([PaddingAwareRouter()])

    def forward(self, input_ids, padding_mask):
        hidden = self.embed(input_ids).reshape(-1, 16)
        return self.layers[0](hidden, padding_mask).float().sum() * hidden.sum()


def test_lengths_counting_padding_exceed_what_the_routers_saw():
    """Within the batch's 16 positions, but the routers saw 8 real tokens: seq_lens counted
    padding (the full width) where it should count real tokens."""
    from transformers import DeepseekV3Config

    model = PaddedModel().train()
    metrics = PolicyMetrics(MetricsConfig(track_moe_metrics=True, track_throughput=True))
    metrics.attach(model, DeepseekV3Config(n_routed_experts=8, num_hidden_layers=1))
    real = torch.tensor([5, 3])
    padding = torch.arange(SEQ).unsqueeze(0) >= real.unsqueeze(1)
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]))  # the width, not the lengths
        model(_ids(), padding).backward()
    with pytest.raises(ValueError, match=r"16 tokens this step, but the MoE routers saw only 8"):
        metrics.finish_step(num_microbatches=1)
    with metrics.step():
        metrics.microbatch(seq_lens=real)
        model(_ids(), padding).backward()
    got = metrics.finish_step(num_microbatches=1)
    assert got[mn.TOKENS] == 8 == got[mn.ROUTED_TOKENS]


ROUTING = MetricsConfig(track_moe_metrics=True, track_routing_consistency=True)


def test_rollout_routes_passed_after_the_forward_are_refused():
    metrics, model = _attached(ROUTING)
    with metrics.step():
        _train(model)
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]), rollout_routes=_routes())
    with pytest.raises(RoutingShapeError, match=r"never used.*before its forward"):
        metrics.finish_step(num_microbatches=1)


def _routes(fill: int | None = None) -> torch.Tensor:
    routes = torch.stack([torch.arange(2)] * (BATCH * SEQ * 2)).reshape(BATCH, SEQ, 2, 2)
    return routes if fill is None else torch.full_like(routes, fill)


def test_routes_without_one_valid_pair_log_no_disagreement_and_bad_ids_are_refused():
    metrics, model = _attached(ROUTING)
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]), rollout_routes=_routes(-1))
        _train(model)
    got = metrics.finish_step(num_microbatches=1)
    assert got[mn.ROUTING_MISSING_FRACTION] == 1.0
    assert mn.ROUTING_DISAGREEMENT not in got and mn.ROUTING_TOPK_OVERLAP not in got
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ, SEQ]), rollout_routes=_routes(8))
        _train(model)
    with pytest.raises(ValueError, match=r"outside \[-1, num_experts\) for 32 .*layer 0: 16"):
        metrics.finish_step(num_microbatches=1)
