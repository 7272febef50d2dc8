"""The synthetic data that ships with the package (algorithms/data.py): deterministic per (seed,
step, rank), right-padded progressions, masks, DPO pairs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron


# ---------------------------------------------------------------- pure parts, no ranks


def test_sft_batches_are_deterministic_and_differ_across_ranks():
    from nemo_moe_metrics.algorithms.data import generator, sft_batch

    a = sft_batch(8, 32, 12, 128, generator(5, 3, 0))
    again = sft_batch(8, 32, 12, 128, generator(5, 3, 0))
    other_rank = sft_batch(8, 32, 12, 128, generator(5, 3, 1))
    other_step = sft_batch(8, 32, 12, 128, generator(5, 4, 0))
    assert torch.equal(a.tokens, again.tokens)
    assert not torch.equal(a.tokens, other_rank.tokens)
    assert not torch.equal(a.tokens, other_step.tokens)


def test_sft_batch_is_right_padded_progressions():
    from nemo_moe_metrics.algorithms.data import generator, sft_batch

    b = sft_batch(16, 32, 12, 128, generator(1, 0, 0))
    for row, n in zip(b.tokens, b.lengths.tolist(), strict=True):
        assert 12 <= n <= 32
        assert (row[n:] == 0).all() and (row[:n] > 0).all()
        diffs = {int((row[i + 1] - row[i]) % 127) for i in range(n - 1)}
        assert len(diffs) == 1 and diffs <= {1, 2, 3}


def test_masks_on_a_hand_made_batch():
    from nemo_moe_metrics.algorithms.data import SequenceBatch

    b = SequenceBatch(
        torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]]), torch.tensor([3, 4]), torch.tensor([1, 2])
    )
    assert b.padding_mask().tolist() == [[False, False, False, True], [False] * 4]
    # Position t predicts token t+1; trained when prompt_len <= t+1 < length.
    assert b.target_mask().tolist() == [[True, True, False], [False, True, True]]


def test_sequence_batch_rejects_lengths_beyond_the_padded_width():
    from nemo_moe_metrics.algorithms.data import SequenceBatch

    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 4\]"):
        SequenceBatch(torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 5]), torch.zeros(2))


def test_dpo_pairs_share_prompt_and_differ_in_response():
    from nemo_moe_metrics.algorithms.data import dpo_batch, generator

    b = dpo_batch(4, 32, 12, 8, 128, generator(2, 0, 0))
    for i in range(0, 8, 2):
        p, n = int(b.prompt_lengths[i]), int(b.lengths[i])
        assert b.prompt_lengths[i + 1] == p and b.lengths[i + 1] == n == p + 8
        assert torch.equal(b.tokens[i, :p], b.tokens[i + 1, :p])
        assert not torch.equal(b.tokens[i, p:n], b.tokens[i + 1, p:n])
