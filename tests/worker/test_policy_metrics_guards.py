"""finish_step refuses a step in which no rank called microbatch(), on real gloo ranks."""

from __future__ import annotations

import pytest
from dist import run_ranks

from nemo_moe_metrics.export import metric_names as mn


def _steps(rank, world_size, callers):
    import torch
    import torch.distributed as dist

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    dist.init_process_group("gloo")
    metrics = PolicyMetrics(MetricsConfig(track_throughput=True))
    from transformers import LlamaConfig

    metrics.attach(
        torch.nn.Linear(2, 2),
        LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2),
    )
    with metrics.step():
        if rank in callers:  # a microbatch of padding only: a real, valid 0 tokens
            metrics.microbatch(seq_lens=torch.tensor([0, 0]))
    try:
        return metrics.finish_step(num_microbatches=1)[mn.TOKENS]
    except RuntimeError as err:
        return str(err)


@pytest.mark.timeout(120)
def test_no_rank_calling_microbatch_raises_on_every_rank_naming_microbatch():
    results = run_ranks(_steps, 2, (), timeout=100)
    assert [status for status, _ in results] == ["ok", "ok"]
    for _, value in results:
        assert isinstance(value, str) and "no rank called microbatch()" in value


@pytest.mark.timeout(120)
def test_one_rank_recording_zero_tokens_is_a_valid_zero_everywhere():
    results = run_ranks(_steps, 2, (0,), timeout=100)
    assert results == [("ok", 0.0), ("ok", 0.0)]
