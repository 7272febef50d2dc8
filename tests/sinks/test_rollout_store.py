"""The rollout engine's own expert loads (sinks/rollout_store.py): counts from routes by hand,
padding left out."""

import pytest
import torch

from nemo_moe_metrics.sinks.rollout_store import (
    counts_from_routes,
)


def test_counts_from_routes_by_hand_with_padding():
    # 3 tokens, 2 layers, top-2; token 2 is padding (-1) in layer 1.
    routes = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 3]], [[0, 2], [-1, -1]]])
    counts = counts_from_routes(routes, 4)
    assert counts.tolist() == [[2, 2, 2, 0], [0, 0, 1, 3]]
    with pytest.raises(ValueError, match="num_experts"):
        counts_from_routes(routes, 3)
