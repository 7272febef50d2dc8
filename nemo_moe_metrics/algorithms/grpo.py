"""Group-relative policy optimisation on the verifiable copy task.

Each prompt is sampled ``num_generations`` times without grad; rewards (copy accuracy) are
normalised within each group; the clipped policy-gradient loss trains on the response tokens.
"""

from __future__ import annotations

import math

import torch

from nemo_moe_metrics.algorithms.common import (
    LogFn,
    masked_sequence_mean,
    merge_step_metrics,
    rank_batch_size,
)
from nemo_moe_metrics.algorithms.data import (
    SequenceBatch,
    copy_prompts,
    copy_reward,
    generator,
    pad,
)
from nemo_moe_metrics.algorithms.ranks import as_rank_group
from nemo_moe_metrics.config import Recipe
from nemo_moe_metrics.export import metric_names as names

ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
CLIP_EPS = 0.2
ROLLOUT_ROUTES = "rollout_routes"  # the worker's SequenceBatch.extras key (megatron_policy.py)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(group)) / (std(group) + eps)`` for consecutive groups of ``group_size``."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).reshape(-1)


def grpo_loss(logprobs: torch.Tensor, mb: SequenceBatch) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate ``-min(rho A, clip(rho) A)`` averaged per sequence, then over sequences."""
    mask = mb.target_mask()
    ratio = torch.exp(logprobs - mb.extras[OLD_LOGPROBS])
    adv = mb.extras[ADVANTAGES].unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
    loss = masked_sequence_mean(-surrogate, mask).mean()
    clipped = ((ratio - 1).abs() > CLIP_EPS).float()
    return loss, {names.TRAIN_CLIP_FRACTION: masked_sequence_mean(clipped, mask).mean()}


def run_grpo(recipe: Recipe, worker, log_fn: LogFn, start_step: int = 0) -> None:
    """GRPO steps: sample groups without grad, score, normalise, one optimizer step each."""
    cfg, model_cfg, train_cfg = recipe.grpo, recipe.policy.model, recipe.training
    gbs = recipe.policy.train_global_batch_size
    if gbs % cfg.num_generations:
        raise ValueError(
            f"train_global_batch_size={gbs} must be a multiple of grpo.num_generations="
            f"{cfg.num_generations} (whole groups per step)"
        )
    if cfg.prompt_length + cfg.response_length > model_cfg.seq_length:
        raise ValueError(
            f"grpo.prompt_length + grpo.response_length = "
            f"{cfg.prompt_length + cfg.response_length} exceeds seq_length={model_cfg.seq_length}"
        )
    # The global batch is NeMo RL's num_prompts_per_step x num_generations_per_prompt over all
    # data-parallel ranks; each rank samples its share of the prompts, in whole groups.
    ranks = as_rank_group(worker)
    per_rank = rank_batch_size(recipe, ranks.dp_size, whole=cfg.num_generations)
    mcfg = recipe.policy.megatron_cfg
    wants_routes = mcfg.track_routing_consistency or mcfg.moe_enable_routing_replay
    for step in range(start_step, train_cfg.max_steps):
        # One generator per data-parallel rank: its prompts, then its rollouts' samples.
        gens = {d: generator(train_cfg.seed, step, d) for d in ranks.dp_ranks}
        prompts = {
            d: copy_prompts(
                per_rank // cfg.num_generations, cfg.prompt_length, model_cfg.vocab_size, g
            ).repeat_interleave(cfg.num_generations, dim=0)
            for d, g in gens.items()
        }
        seqs = ranks.generate(
            prompts, cfg.response_length, cfg.temperature, gens, precision=cfg.rollout_precision
        )
        rewards = {d: copy_reward(prompts[d], seqs[d][:, cfg.prompt_length :]) for d in gens}
        batches = {}
        for d in gens:
            batch = pad(list(seqs[d]), model_cfg.seq_length, [cfg.prompt_length] * len(seqs[d]))
            batch.extras[ADVANTAGES] = group_advantages(rewards[d], cfg.num_generations)
            batches[d] = batch
        if wants_routes:
            # The rollout's own routes, as an engine returns them (vLLM's routed_experts).
            routes = ranks.rollout_routes(batches, cfg.rollout_precision)
            for d, r in routes.items():
                batches[d].extras[ROLLOUT_ROUTES] = r
        for d, old in ranks.logprobs(batches).items():
            batches[d].extras[OLD_LOGPROBS] = old
        result = ranks.train(batches, grpo_loss)
        # Mean and (population) std over every rank's rollouts, not a mean of per-rank stds.
        moments = ranks.mean_over_dp(
            {d: {"r": float(r.mean()), "r2": float((r**2).mean())} for d, r in rewards.items()}
        )
        own = {
            names.TRAIN_REWARD: moments["r"],
            names.TRAIN_REWARD_STD: math.sqrt(max(moments["r2"] - moments["r"] ** 2, 0.0)),
        }
        log_fn(merge_step_metrics(own, result), step)
