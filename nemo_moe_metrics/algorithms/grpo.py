"""Group-relative policy optimisation on the verifiable copy task.

Each prompt is sampled ``num_generations`` times without grad; rewards (copy accuracy) are
normalised within each group; the clipped policy-gradient loss trains on the response tokens.
"""

from __future__ import annotations

import math

import torch

from nemo_moe_metrics import metric_names as names
from nemo_moe_metrics.algorithms.common import (
    LogFn,
    dp_mean,
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
from nemo_moe_metrics.config import Recipe

ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
CLIP_EPS = 0.2
ROLLOUT_ROUTES = "rollout_routes"  # the worker's SequenceBatch.extras key (megatron.policy)


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
    per_rank = rank_batch_size(recipe, worker.dp_size, whole=cfg.num_generations)
    mcfg = recipe.policy.megatron_cfg
    wants_routes = mcfg.track_routing_consistency or mcfg.moe_enable_routing_replay
    precision = {} if cfg.rollout_precision == "fp32" else {"precision": cfg.rollout_precision}
    for step in range(start_step, train_cfg.max_steps):
        g = generator(train_cfg.seed, step, worker.dp_rank)
        prompts = copy_prompts(
            per_rank // cfg.num_generations, cfg.prompt_length, model_cfg.vocab_size, g
        )
        prompts = prompts.repeat_interleave(cfg.num_generations, dim=0)
        seqs = worker.generate(
            prompts, cfg.response_length, cfg.temperature, generator=g, **precision
        ).cpu()
        rewards = copy_reward(prompts, seqs[:, cfg.prompt_length :])
        batch = pad(list(seqs), model_cfg.seq_length, [cfg.prompt_length] * len(seqs))
        batch.extras[ADVANTAGES] = group_advantages(rewards, cfg.num_generations)
        if wants_routes:
            # The rollout's own routes, as an engine returns them (vLLM's routed_experts).
            batch.extras[ROLLOUT_ROUTES] = worker.rollout_routes(batch, cfg.rollout_precision).cpu()
        batch.extras[OLD_LOGPROBS] = worker.logprobs(batch)
        result = worker.train(batch, grpo_loss)
        # Mean and (population) std over every rank's rollouts, not a mean of per-rank stds.
        moments = dp_mean(
            {"r": float(rewards.mean()), "r2": float((rewards**2).mean())},
            worker.dp_group,
            worker.dp_size,
        )
        own = {
            names.TRAIN_REWARD: moments["r"],
            names.TRAIN_REWARD_STD: math.sqrt(max(moments["r2"] - moments["r"] ** 2, 0.0)),
        }
        log_fn(merge_step_metrics(own, result), step)
