"""Real tokens per sequence (throughput/sequence_lengths.py): from a padding mask and from packed
offsets."""

from __future__ import annotations

import torch

from nemo_moe_metrics.throughput import (
    lengths_from_attention_mask,
    lengths_from_cu_seqlens,
)


def test_length_helpers_count_real_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert lengths_from_attention_mask(mask).tolist() == [3, 1, 0]
    cu = torch.tensor([0, 5, 12, 12, 20], dtype=torch.int32)
    assert lengths_from_cu_seqlens(cu).tolist() == [5, 7, 0, 8]
