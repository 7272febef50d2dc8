"""Preflight: the recipe's model, parallel layout, batches and data checked together, before launch.

Each key is validated alone in :mod:`nemo_moe_metrics.config`; what only fails when keys meet
(experts across expert-parallel ranks, the world size against the parallel sizes, batches
against the algorithm, sequence lengths against the synthetic data of
:mod:`nemo_moe_metrics.algorithms.data`) is checked here, so ``check`` and ``run`` reject it in
a second instead of a rank failing deep inside megatron-core after the launch.
Plain arithmetic on the recipe: nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from nemo_moe_metrics.config.recipe import ConfigError, DPOConfig, Recipe

MODEL = "policy.model"
MCFG = "policy.megatron_cfg"


def _nproc(n: int) -> str:
    return f"--nproc {n}"


@dataclass(frozen=True)
class RankWords:
    """How the caller chooses the number of ranks, so that messages speak its own options.

    ``given(n)`` describes the ranks asked for; ``use(n)`` is the option setting that gives
    ``n`` ranks (or a multiple). The default is ``nemo-moe-metrics run/check --nproc``.
    """

    name: str = "--nproc"
    given: Callable[[int], str] = _nproc
    use: Callable[[int], str] = _nproc


def slurm_rank_words(nodes: int, per_node: int, cpu: bool = False) -> RankWords:
    """:class:`RankWords` for ``recipes/slurm.py``: ranks are ``--nodes`` x ``--gpus-per-node``.

    With ``cpu`` (``--gpus-per-node 0``) the ranks per node are ``--ranks-per-node``.
    """
    option, unit = ("--ranks-per-node", "ranks") if cpu else ("--gpus-per-node", "GPUs")

    def given(n: int) -> str:
        return f"--nodes {nodes} x {option} {per_node} ({n} {unit})"

    def use(n: int) -> str:
        count = max(1, n // math.gcd(max(nodes, 1), n)) if n else 1
        with_nodes = f" with --nodes {nodes}" if nodes > 1 else ""
        return f"{option} {count}{with_nodes}"

    return RankWords(name=f"--nodes x {option}", given=given, use=use)


def layout_problems(
    recipe: Recipe, nproc: int | None = None, words: RankWords | None = None
) -> list[str]:
    """Every problem with running ``recipe`` on ``nproc`` ranks (``None``: skip world-size checks).

    Each message names the keys with their values and the fix; rank counts are described in
    ``words`` (default: ``--nproc``).
    """
    words = words or RankWords()
    model, mcfg, policy = recipe.policy.model, recipe.policy.megatron_cfg, recipe.policy
    ep, pp, cp = (
        mcfg.expert_model_parallel_size,
        mcfg.pipeline_model_parallel_size,
        mcfg.context_parallel_size,
    )
    problems: list[str] = []

    # --- model x parallel layout
    if model.is_moe and model.num_experts % ep:
        divisors = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
        problems.append(
            f"{MODEL}.num_experts={model.num_experts} is not divisible by "
            f"{MCFG}.expert_model_parallel_size={ep} (each expert-parallel rank holds "
            f"num_experts / {ep} experts); set num_experts to a multiple of {ep} "
            f"(e.g. {model.num_experts + ep - model.num_experts % ep}) or "
            f"expert_model_parallel_size to one of {divisors}"
        )
    if model.num_experts is not None and model.moe_router_topk > model.num_experts:
        problems.append(
            f"{MODEL}.moe_router_topk={model.moe_router_topk} exceeds "
            f"{MODEL}.num_experts={model.num_experts}; set moe_router_topk <= num_experts"
        )
    if pp != 1 or cp != 1:
        problems.append(
            f"{MCFG}.pipeline_model_parallel_size={pp} and {MCFG}.context_parallel_size={cp}: "
            "the reference policy worker scores and samples with plain forwards, which need the "
            "whole model on each rank; set both to 1 (expert parallelism is supported)"
        )

    # --- world size x parallel sizes (tensor parallel is 1: MoE with TP needs sequence parallel)
    if nproc is not None:
        model_parallel = pp * cp
        if nproc < 1:
            problems.append(f"{words.name} must be at least 1, got {nproc}")
        elif nproc % model_parallel:
            problems.append(
                f"{words.given(nproc)} is not tensor 1 x pipeline {pp} x context {cp} x "
                f"data-parallel D for a whole D ({MCFG}.pipeline_model_parallel_size={pp}, "
                f"context_parallel_size={cp}); use a multiple of {model_parallel}, "
                f"e.g. {words.use(model_parallel * max(1, nproc // model_parallel))}"
            )
        elif (nproc // pp) % ep:
            fit = ep * pp
            problems.append(
                f"{words.given(nproc)} does not fit {MCFG}.expert_model_parallel_size={ep}: the "
                f"{nproc // pp} ranks of a pipeline stage (data-parallel x context) must split "
                f"into expert-parallel groups of {ep}; use {words.use(fit)} (or a multiple of "
                f"it), or override {MCFG}.expert_model_parallel_size to a divisor of {nproc // pp}"
            )

    # --- batches (train_global_batch_size counts every data-parallel rank, as in NeMo RL)
    gbs, mbs = policy.train_global_batch_size, policy.train_micro_batch_size
    dp = data_parallel_size(recipe, nproc)
    ranks = dp or 1
    groups = recipe.grpo.num_generations if recipe.algorithm == "grpo" else 1
    unit = ranks * math.lcm(mbs, groups)  # the smallest global batch that fits every rule
    fix = f"set train_global_batch_size to a multiple of {unit} (e.g. {_round_up(gbs, unit)})"
    over = (
        f"over all {ranks} data-parallel ranks of {words.given(nproc)} (as in NeMo RL and "
        f"Megatron): each rank trains {gbs}/{ranks} of them"
        if ranks > 1
        else "(one data-parallel rank)"
    )
    if gbs % (ranks * mbs):
        problems.append(
            f"policy.train_global_batch_size={gbs} is not a multiple of data-parallel size "
            f"{ranks} x policy.train_micro_batch_size={mbs}: it counts the step's sequences "
            f"{over}, in microbatches of {mbs}; {fix}"
        )
    elif (gbs // ranks) % groups:
        problems.append(
            f"policy.train_global_batch_size={gbs} is not a multiple of data-parallel size "
            f"{ranks} x grpo.num_generations={groups}: each data-parallel rank samples whole "
            f"groups of {groups} (the global batch is NeMo RL's num_prompts_per_step x "
            f"num_generations_per_prompt, counted {over}); {fix}"
        )
    seq = model.seq_length
    if recipe.algorithm == "sft":
        low = recipe.training.min_seq_length
        if not 2 <= low <= seq:
            problems.append(
                f"training.min_seq_length={low} must lie in [2, {MODEL}.seq_length={seq}] "
                "(synthetic SFT sequences are min_seq_length..seq_length tokens); lower "
                "training.min_seq_length or raise seq_length"
            )
    elif recipe.algorithm == "dpo":
        if gbs % 2 or mbs % 2:
            problems.append(
                f"policy.train_global_batch_size={gbs} and policy.train_micro_batch_size={mbs} "
                "must both be even for DPO (a microbatch holds whole chosen/rejected pairs)"
            )
        response = DPOConfig.response_length(seq)
        if seq - response < 2:
            problems.append(
                f"{MODEL}.seq_length={seq} leaves no room for a prompt before DPO's "
                f"{response}-token response (seq_length // 4); raise seq_length to at least 4"
            )
    elif recipe.algorithm == "grpo":
        g = recipe.grpo
        if g.prompt_length + g.response_length > seq:
            problems.append(
                f"grpo.prompt_length={g.prompt_length} + grpo.response_length="
                f"{g.response_length} exceeds {MODEL}.seq_length={seq}; raise seq_length to "
                f"{g.prompt_length + g.response_length} or shorten the prompt or response"
            )
    return problems


def data_parallel_size(recipe: Recipe, nproc: int | None) -> int | None:
    """Data-parallel ranks of ``recipe`` on ``nproc`` ranks (tensor 1 x pipeline x context x
    data; expert parallelism splits the data-parallel ranks), None when unknown or not whole."""
    mcfg = recipe.policy.megatron_cfg
    model_parallel = mcfg.pipeline_model_parallel_size * mcfg.context_parallel_size
    if nproc is None or nproc < 1 or nproc % model_parallel:
        return None
    return nproc // model_parallel


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def _statement_and_details(problem: str) -> tuple[str, str]:
    """Split a problem at its first ``: `` or ``; `` outside brackets: what is wrong, then why
    and the fix. The statement stays on one line, so it can be searched for as it is."""
    depth = 0
    for i, char in enumerate(problem):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char in ":;" and depth == 0 and problem[i + 1 : i + 2] == " ":
            return problem[: i + 1], problem[i + 2 :]
    return problem, ""


def layout_message(name: str, problems: list[str]) -> str:
    """``recipe NAME cannot run:``, then each problem's statement on its own line and its
    details wrapped below it (no line of hundreds of characters in a terminal)."""
    lines = [f"recipe {name!r} cannot run:"]
    bullet = "  - " if len(problems) > 1 else "  "
    for problem in problems:
        statement, details = _statement_and_details(problem)
        lines.append(bullet + statement)
        if details:
            lines += textwrap.wrap(
                details,
                width=100,
                initial_indent="    ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def preflight(recipe: Recipe, nproc: int | None = None, words: RankWords | None = None) -> None:
    """Raise :class:`ConfigError` listing every problem :func:`layout_problems` finds."""
    problems = layout_problems(recipe, nproc, words)
    if problems:
        raise ConfigError(layout_message(recipe.name, problems))


def layout_summary(recipe: Recipe, nproc: int) -> str:
    """What ``check`` prints after a recipe passes: the layout on ``nproc`` ranks, then ``OK``.

    Call after :func:`preflight` (the divisions here are then whole).
    """
    model, mcfg, policy = recipe.policy.model, recipe.policy.megatron_cfg, recipe.policy
    pp, cp, ep = (
        mcfg.pipeline_model_parallel_size,
        mcfg.context_parallel_size,
        mcfg.expert_model_parallel_size,
    )
    dp = nproc // (pp * cp)
    gbs, mbs = policy.train_global_batch_size, policy.train_micro_batch_size
    per_rank = gbs // dp
    if model.is_moe and model.num_experts is not None:
        experts = (
            f"experts per rank: {model.num_experts // ep} of {model.num_experts} "
            f"(expert-parallel {ep}, top-{model.moe_router_topk})"
        )
    else:
        experts = "experts per rank: none (a dense model)"
    lines = [
        f"layout on {nproc} rank(s):",
        f"  data-parallel size: {dp} (tensor 1 x pipeline {pp} x context {cp} x data {dp})",
        f"  {experts}",
        f"  sequences per step: {gbs} over all {dp} data-parallel rank(s) "
        f"(policy.train_global_batch_size, as in NeMo RL and Megatron), {per_rank} per rank",
        f"  microbatches per rank: {per_rank // mbs} per step, {mbs} sequences each",
    ]
    if recipe.algorithm == "grpo":
        g = recipe.grpo.num_generations
        lines.append(
            f"  rollouts per step: {gbs // g} prompts x {g} generations (NeMo RL's "
            "grpo.num_prompts_per_step x num_generations_per_prompt)"
        )
    lines += [
        f"OK: recipe {recipe.name!r} can run on {nproc} rank(s) "
        f"({recipe.training.max_steps} steps of {recipe.algorithm})",
    ]
    return "\n".join(lines)
