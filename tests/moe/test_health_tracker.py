"""Router health's accumulators (moe/health_tracker.py): logits wider than the described classes
refused with the layer; kept forwards judged with the bias each forward saw."""

import pytest
import torch
from health_oracle import NEAR_TIE_GAP

from nemo_moe_metrics.moe.router_health import (
    RouterScoring,
    decision_sums,
)

torch.set_num_threads(1)


def test_logits_wider_than_the_described_classes_are_refused_with_the_layer():
    from nemo_moe_metrics.moe.health_tracker import RouterHealthTracker

    tracker = RouterHealthTracker(
        {5: RouterScoring("softmax", 8, 2)}, near_tie_gap=NEAR_TIE_GAP, device=torch.device("cpu")
    )
    counts = torch.tensor([3, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="MoE layer 5: the router's logits have 9 columns"):
        tracker.observe(5, counts, torch.randn(2, 9))


def test_kept_forwards_are_judged_with_the_bias_each_forward_saw():
    # The tracker judges a step's forwards together at its end, after megatron has moved the
    # expert bias in place: each forward must be judged with the bias it was routed with, and
    # forwards of different lengths and layers summed into their own layer's row.
    from nemo_moe_metrics.moe.health_tracker import RouterHealthTracker
    from nemo_moe_metrics.moe.router_health import SLOTS

    scoring = RouterScoring("sigmoid", 8, 2)
    tracker = RouterHealthTracker(
        {0: scoring, 1: scoring}, near_tie_gap=NEAR_TIE_GAP, device=torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(8, generator=gen)
    counts = torch.ones(8, dtype=torch.int64)
    expected = torch.zeros(2, SLOTS, dtype=torch.float64)
    peaks = torch.zeros(2, dtype=torch.float64)
    for step_part, (layer, tokens) in enumerate([(0, 5), (1, 7), (0, 3), (1, 4)]):
        z = torch.randn(tokens, 8, generator=gen)
        sums, peak = decision_sums(z, scoring, near_tie_gap=NEAR_TIE_GAP, bias=bias.clone())
        expected[layer, : sums.numel()] += sums
        peaks[layer] = max(peaks[layer], float(peak))
        tracker.observe(layer, counts, z, bias=bias)
        if step_part == 1:
            bias.add_(0.5)  # moved in place between microbatches
    bias.add_(1.0)  # and again before the step's end (megatron's update)
    sums, max_abs = tracker.local_stats()
    decision = len(sums[0]) - 2  # the microbatch-balance slots are the counts' own
    # float32 per token (a batch may round the last bit differently), float64 sums
    torch.testing.assert_close(sums[:, :decision], expected[:, :decision], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(max_abs, peaks)
