"""Direct preference optimisation against a frozen reference policy.

As in NeMo RL, the reference is the SAME model with the initial weights swapped in
(state-dict swap) and scored under ``torch.no_grad()`` in eval mode: no second model in memory,
and those forwards are not training (a metrics hook must not count them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_moe_metrics.algorithms.common import LogFn, merge_step_metrics, rank_batch_size
from nemo_moe_metrics.algorithms.data import SequenceBatch, dpo_batch, generator
from nemo_moe_metrics.algorithms.ranks import as_rank_group
from nemo_moe_metrics.config import DPOConfig, Recipe
from nemo_moe_metrics.export import metric_names as names

REF_LOGPROBS = "ref_logprobs"


def make_dpo_loss(beta: float):
    """The DPO loss over microbatches laid out chosen, rejected, chosen, rejected, ..."""

    def dpo_loss(logprobs: torch.Tensor, mb: SequenceBatch) -> tuple[torch.Tensor, dict]:
        mask = mb.target_mask().to(logprobs.dtype)
        # Implicit reward: beta * (log pi(y|x) - log pi_ref(y|x)) over the response tokens.
        ratio = ((logprobs - mb.extras[REF_LOGPROBS]) * mask).sum(dim=1)
        chosen, rejected = beta * ratio[0::2], beta * ratio[1::2]
        loss = -F.logsigmoid(chosen - rejected).mean()
        return loss, {
            names.TRAIN_CHOSEN_REWARD: chosen.detach().mean(),
            names.TRAIN_REJECTED_REWARD: rejected.detach().mean(),
            names.TRAIN_PREFERENCE_ACCURACY: (chosen > rejected).float().mean(),
        }

    return dpo_loss


def run_dpo(recipe: Recipe, worker, log_fn: LogFn, start_step: int = 0) -> None:
    """DPO steps on synthetic pairs; the reference is the worker's weights at the start."""
    gbs, mbs = recipe.policy.train_global_batch_size, recipe.policy.train_micro_batch_size
    if gbs % 2 or mbs % 2:
        raise ValueError(
            f"DPO trains on (chosen, rejected) pairs that must share a microbatch: "
            f"train_global_batch_size={gbs} and train_micro_batch_size={mbs} must both be even"
        )
    model_cfg, train_cfg = recipe.policy.model, recipe.training
    ranks = as_rank_group(worker)
    per_rank = rank_batch_size(recipe, ranks.dp_size, whole=2)
    ranks.snapshot_reference()
    loss_fn = make_dpo_loss(recipe.dpo.beta)
    for step in range(start_step, train_cfg.max_steps):
        batches = {
            d: dpo_batch(
                per_rank // 2,
                model_cfg.seq_length,
                train_cfg.min_seq_length,
                DPOConfig.response_length(model_cfg.seq_length),
                model_cfg.vocab_size,
                generator(train_cfg.seed, step, d),
            )
            for d in ranks.dp_ranks
        }
        for d, ref in ranks.reference_logprobs(batches).items():
            batches[d].extras[REF_LOGPROBS] = ref
        result = ranks.train(batches, loss_fn)
        log_fn(merge_step_metrics({}, result), step)


__all__ = ["make_dpo_loss", "run_dpo"]
