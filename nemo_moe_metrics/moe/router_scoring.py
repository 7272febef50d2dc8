"""Where each router family keeps what router health needs: logits, score function, bias, groups.

One function per family, called once per router when ``track_router_health`` is on
(``ExpertLoadCollector.enable_health``). Each returns a :class:`HealthSource` (the router's
static :class:`~nemo_moe_metrics.moe.router_health.RouterScoring` and a reader of one forward's
logits, expert bias and padding) or a string saying why this router's decisions cannot be
judged; such a router gets no router-health keys (and one warning), never made-up numbers.

The logits are the ones the router computes itself, captured where they appear, so health adds
no second gating matmul:

- megatron-core ``TopKRouter``: the output of its ``gating`` (``megatron.compat``
  wraps it on the instance), before z-loss, score function and bias;
- transformers routers: the first item of their output ``(logits, weights, indices)``;
- torchtitan ``TokenChoiceTopKRouter``: a forward hook on its ``gate`` linear (the router
  itself returns scores after the score function).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.moe.router_health import SCORE_FUNCTIONS, RouterScoring

#: ``read(args, kwargs, output) -> (logits or None, expert bias [E] or None, valid [T] or None)``
HealthReader = Callable[[tuple, dict, Any], tuple[Any, Any, Any]]


@dataclass(frozen=True)
class HealthSource:
    """How to judge one router: its scoring, a per-forward reader, and how to undo captures."""

    scoring: RouterScoring
    read: HealthReader
    release: Callable[[], None] | None = None


def _padding_valid(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # megatron-core: padding_mask True = padding (see moe.hooks._megatron_counts).
    padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    return None if padding_mask is None else ~padding_mask.reshape(-1).bool()


def megatron_health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """megatron-core ``TopKRouter``: score function, pre-softmax and groups from its config."""
    from nemo_moe_metrics.megatron import compat

    cfg = router.config
    routing = getattr(router, "routing_type", cfg.moe_router_load_balancing_type)
    if routing in ("sinkhorn", "quantile_balancing"):
        return f"{routing} routing has no top-k of scores to judge"
    if getattr(cfg, "moe_router_force_load_balancing", False):
        return "moe_router_force_load_balancing routes random logits"
    if getattr(cfg, "moe_router_force_biased", None) is not None:
        return "moe_router_force_biased routes biased random logits"
    score = getattr(router, "score_function", getattr(cfg, "moe_router_score_function", None))
    if score not in SCORE_FUNCTIONS:
        return f"score function {score!r} is not one of {SCORE_FUNCTIONS}"
    topk = int(router.topk)
    group_topk = getattr(cfg, "moe_router_group_topk", None)
    scoring = RouterScoring(
        score_function=score,
        num_experts=int(cfg.num_moe_experts),
        topk=topk,
        rank_on_logits=score == "softmax" and not getattr(cfg, "moe_router_pre_softmax", False),
        num_groups=getattr(cfg, "moe_router_num_groups", None),
        group_topk=group_topk,
        group_score_topk=topk // group_topk if group_topk else 2,
    )
    compat.capture_router_logits(router)
    # megatron-core adds expert_bias to sigmoid / sqrt-softplus scores only; its softmax path
    # routes without it even when the buffer exists.
    biased = score != "softmax"

    def read(args: tuple, kwargs: dict, output: Any):
        bias = getattr(router, "expert_bias", None) if biased else None
        return compat.pop_router_logits(router), bias, _padding_valid(args, kwargs)

    return HealthSource(scoring, read, lambda: compat.release_router_logits(router))


# transformers routers whose score function is checked against their code (tests/
# test_router_health.py runs each): model type -> score function. Bias and groups are read from
# the module (DeepSeek-V3 style: e_score_correction_bias, n_group / num_group, topk_group).
HF_SCORE_FUNCTIONS: dict[str, str] = {
    "qwen2_moe": "softmax",
    "qwen3_moe": "softmax",
    "qwen3_next": "softmax",
    "qwen3_5_moe": "softmax",
    "mixtral": "softmax",
    "olmoe": "softmax",
    "gpt_oss": "softmax",
    "deepseek_v3": "sigmoid",
}
_SCORE_ATTRIBUTES = ("score_function", "score_func", "scoring_func")


def hf_model_type(router: nn.Module) -> str | None:
    """``qwen3_moe`` for a class in ``transformers.models.qwen3_moe.modeling_qwen3_moe``."""
    parts = type(router).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["transformers", "models"] else None


def hf_score_function(router: nn.Module) -> str | None:
    """The router's score function: an attribute naming it, else the checked family table."""
    for name in _SCORE_ATTRIBUTES:
        value = getattr(router, name, None)
        if isinstance(value, str):
            return value
    return HF_SCORE_FUNCTIONS.get(hf_model_type(router) or "")


def hf_health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """A transformers router returning ``(logits, weights, indices)``; its first item is ``z``.

    Works for any router module that says its score function (an attribute ``score_function``
    / ``score_func`` / ``scoring_func``, or a model type in :data:`HF_SCORE_FUNCTIONS`); an
    ``e_score_correction_bias`` buffer is the expert bias, ``n_group`` (or ``num_group``) with
    ``topk_group`` the group limit (group score: sum of the best two, as DeepSeek-V3).
    """
    score = hf_score_function(router)
    if score not in SCORE_FUNCTIONS:
        kind = hf_model_type(router) or type(router).__qualname__
        return (
            f"the score function of {kind} routers is not known (checked families: "
            f"{', '.join(sorted(HF_SCORE_FUNCTIONS))})"
        )
    groups = getattr(router, "n_group", getattr(router, "num_group", None))
    group_topk = getattr(router, "topk_group", None)
    scoring = RouterScoring(
        score_function=score,
        num_experts=int(router.num_experts),
        topk=int(getattr(router, "top_k", getattr(router, "topk", 0))),
        num_groups=int(groups) if groups else None,
        group_topk=int(group_topk) if groups and group_topk else None,
    )

    def read(args: tuple, kwargs: dict, output: Any):
        return output[0], getattr(router, "e_score_correction_bias", None), None

    return HealthSource(scoring, read)


def hf_experts_health(experts: nn.Module, block: nn.Module | None) -> HealthSource | str:
    """A transformers experts module (``moe.hf_models``): the router beside it in its MoE block.

    The router is the block's child that returns ``(logits, weights, indices)`` (``gate`` or
    ``router``, or a class named ``...Router``); its logits are captured by a forward hook on
    it and read when the experts run, in the same forward.
    """
    candidates = [
        child
        for name, child in (block.named_children() if block is not None else ())
        if child is not experts and (name in ("gate", "router") or "Router" in type(child).__name__)
    ]
    if len(candidates) != 1:
        return f"no single router next to {type(experts).__qualname__} in its MoE block"
    router = candidates[0]
    found = hf_health(router, block)
    if isinstance(found, str):
        return found
    captured: dict[str, Any] = {"logits": None}

    def keep(module: nn.Module, args: tuple, output: Any) -> None:
        captured["logits"] = output[0] if isinstance(output, tuple) else None

    handle = router.register_forward_hook(keep)

    def read(args: tuple, kwargs: dict, output: Any):
        logits, captured["logits"] = captured["logits"], None
        return logits, getattr(router, "e_score_correction_bias", None), None

    return HealthSource(found.scoring, read, handle.remove)


def torchtitan_health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """torchtitan ``TokenChoiceTopKRouter``: the gate's output is ``z``; the bias is its argument."""
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
