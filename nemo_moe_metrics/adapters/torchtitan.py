"""torchtitan's MoE family: config facts, and its ``TokenChoiceTopKRouter`` read as a RouterSpec.

torchtitan (0.3.0) builds a model from a nested ``Decoder.Config`` (``DeepSeekV3Model.Config``,
``Qwen3Model.Config``, ...) whose ``layers`` list holds one block config per layer; a block
with ``moe`` set is an MoE layer (``MoE.Config``: ``num_experts``, ``router.top_k``,
``load_balance_coeff``). The routers (``TokenChoiceTopKRouter``) are counted by the same
collector as every other family (``moe.collector``); their expert ids are the routing after the
aux-loss-free bias and any group limit. Nothing here imports torchtitan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily, router_by_class
from nemo_moe_metrics.flops.torchtitan import is_torchtitan_config, torchtitan_flops_estimator
from nemo_moe_metrics.moe.router_health import SCORE_FUNCTIONS, RouterScoring
from nemo_moe_metrics.moe.router_spec import HealthSource, RouterSpec, count_experts


def moe_layer_configs(config: Any) -> list[tuple[int, Any]]:
    """``(layer index, MoE.Config)`` of every MoE layer of the main decoder (MTP excluded)."""
    return [
        (i, block.moe)
        for i, block in enumerate(config.layers)
        if getattr(block, "moe", None) is not None
    ]


def torchtitan_facts(config: Any) -> ModelFacts:
    """Experts, layers, top-k and expert bias of a torchtitan ``Decoder.Config``."""
    moes = moe_layer_configs(config)
    experts = {int(moe.num_experts) for _, moe in moes}
    if len(experts) > 1:
        raise ValueError(f"torchtitan config: MoE layers disagree on num_experts {sorted(experts)}")
    bias = any(getattr(moe, "load_balance_coeff", None) is not None for _, moe in moes)
    # top_k sits on the router's config (MoE.Config.router) in 0.3.0
    topks = {getattr(moe, "top_k", None) or getattr(moe.router, "top_k", None) for _, moe in moes}
    topk = topks.pop() if len(topks) == 1 else None
    experts_per_layer = experts.pop() if experts else 0
    return ModelFacts(
        experts_per_layer, len(config.layers), 1, None, "torchtitan", expert_bias=bias, topk=topk
    )


def _counts(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # TokenChoiceTopKRouter.forward(x_BLD, expert_bias_E) -> (topk_scores_BLK,
    # topk_expert_ids_BLK, scores_BLE): count the expert ids (after the bias and any group
    # limit), as MoE.forward does for its tokens_per_expert_E; no padding mask reaches it.
    ids = output[1]
    ids = ids.to_local() if hasattr(ids, "to_local") else ids  # DTensor under TP/SP
    return count_experts(ids, module.num_experts), ids.numel() // ids.shape[-1]


def health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """torchtitan ``TokenChoiceTopKRouter``: the gate's output is ``z``; the bias is its
    argument."""
    if getattr(router, "_debug_force_load_balance", False):
        return "_debug_force_load_balance routes round-robin"
    if router.score_func not in SCORE_FUNCTIONS:
        return f"score function {router.score_func!r} is not one of {SCORE_FUNCTIONS}"
    groups = router.num_expert_groups
    scoring = RouterScoring(
        score_function=router.score_func,
        num_experts=int(router.num_experts),
        topk=int(router.top_k),
        num_groups=int(groups) if groups else None,
        group_topk=int(router.num_limited_groups) if groups else None,
    )
    captured: dict[str, torch.Tensor | None] = {"logits": None}

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        captured["logits"] = output

    handle = router.gate.register_forward_hook(keep)

    def read(args: tuple, kwargs: dict, output: Any):
        logits, captured["logits"] = captured["logits"], None
        if logits is not None and hasattr(logits, "to_local"):  # DTensor under TP/SP
            logits = logits.to_local()
        bias = kwargs.get("expert_bias_E", args[1] if len(args) > 1 else None)
        if bias is not None and hasattr(bias, "to_local"):
            bias = bias.to_local()
        return logits, bias, None

    return HealthSource(scoring, read, handle.remove)


SPEC = RouterSpec(
    counts_fn=_counts,
    num_experts=lambda m: int(m.num_experts),
    topk=lambda m: int(m.top_k),
    # load_balance_coeff set: the parent MoE keeps expert_bias_E (None otherwise).
    expert_bias=lambda router, parent: getattr(parent, "expert_bias_E", None),
    health=health,
)
#: the router class this spec reads, by qualified name (nothing is imported to recognise it)
ROUTER_CLASS = "torchtitan.models.common.moe.TokenChoiceTopKRouter"


FAMILY = ModelFamily(
    name="torchtitan",
    owns_config=is_torchtitan_config,
    facts=torchtitan_facts,
    router_spec=router_by_class({ROUTER_CLASS: SPEC}),
    flops=lambda config, vocab_size, model: torchtitan_flops_estimator(
        config, vocab_size=vocab_size
    ),
)
