"""Supervised fine-tuning on the synthetic next-token task."""

from __future__ import annotations

import torch

from nemo_moe_metrics.algorithms.common import (
    LogFn,
    masked_sequence_mean,
    merge_step_metrics,
    rank_batch_size,
)
from nemo_moe_metrics.algorithms.data import SequenceBatch, generator, sft_batch
from nemo_moe_metrics.algorithms.ranks import as_rank_group
from nemo_moe_metrics.config import Recipe
from nemo_moe_metrics.export import metric_names as names


def sft_loss(logprobs: torch.Tensor, mb: SequenceBatch) -> tuple[torch.Tensor, dict]:
    """Mean over sequences of each sequence's mean next-token NLL over its real tokens."""
    mask = mb.target_mask()
    loss = masked_sequence_mean(-logprobs, mask).mean()
    # A token is "right" when the model gives it more than half the probability mass:
    # a greedy-free accuracy that needs no argmax over the vocabulary here.
    accuracy = masked_sequence_mean((logprobs > -0.6931).float(), mask).mean()
    return loss, {names.TRAIN_TOKEN_ACCURACY: accuracy.detach()}


def run_sft(recipe: Recipe, worker, log_fn: LogFn, start_step: int = 0) -> None:
    """``recipe.training.max_steps`` optimizer steps; ``log_fn(metrics, step)`` once per step.

    ``worker``: this rank's worker (SPMD) or a rank group (:mod:`.ranks`, a Ray driver's).
    Each data-parallel rank trains its share of ``policy.train_global_batch_size``."""
    model_cfg, train_cfg = recipe.policy.model, recipe.training
    ranks = as_rank_group(worker)
    per_rank = rank_batch_size(recipe, ranks.dp_size)
    for step in range(start_step, train_cfg.max_steps):
        batches = {
            d: sft_batch(
                per_rank,
                model_cfg.seq_length,
                train_cfg.min_seq_length,
                model_cfg.vocab_size,
                generator(train_cfg.seed, step, d),
            )
            for d in ranks.dp_ranks
        }
        result = ranks.train(batches, sft_loss)
        log_fn(merge_step_metrics({}, result), step)
