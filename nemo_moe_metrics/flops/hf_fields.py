"""What transformers' MoE configs and modules say about themselves, read without importing it.

The config fields that hold the routed experts and experts per token (they differ by family),
whether a module follows transformers' experts interface, how many experts it holds, and the
ids and weights an experts call was given. Used by the router adapter (``adapters.hf``), the health
readers (``adapters.hf_health``), the model facts (``adapters.hf``) and the FLOP estimate
read from a built model (``flops.hf_module_tree``): here, below the adapters that import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: Config fields that hold the number of routed experts / experts per token, by family.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_FIELDS = (
    "num_experts_per_tok",
    "moe_topk",
    "moe_k",
    "num_experts_per_token",
    "top_k_experts",
    "experts_per_token",
    "moe_top_k",
)
#: Configs whose MoE blocks a flag switches off (a dense model keeps its expert-count default).
_MOE_SWITCHES = ("is_moe", "enable_moe_block")


def _first_field(config: Any, fields: Iterable[str]) -> int | None:
    for source in (config, getattr(config, "ffn_config", None)):  # dbrx nests its MoE fields
        if source is None:
            continue
        for field in fields:
            value = getattr(source, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def config_num_experts(config: Any) -> int:
    """Routed experts per MoE layer a transformers (text) config describes; 0 for a dense model."""
    if any(getattr(config, switch, True) is False for switch in _MOE_SWITCHES):
        return 0
    return _first_field(config, EXPERT_COUNT_FIELDS) or 0


def config_topk(config: Any) -> int | None:
    """Experts per token a transformers (text) config describes, or None when it names none."""
    return _first_field(config, TOPK_FIELDS)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` follows transformers' experts interface (decorator or call signature)."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_filename.replace("\\", "/").endswith("integrations/moe.py"):
        return True
    return _call_signature(type(module)) == ("top_k_index", "top_k_weights")


_SIGNATURES: dict[type, tuple[str, ...]] = {}


def _call_signature(cls: type) -> tuple[str, ...]:
    if cls not in _SIGNATURES:
        try:
            params = list(inspect.signature(cls.forward).parameters)[2:4]
        except (TypeError, ValueError, AttributeError):
            params = []
        _SIGNATURES[cls] = tuple(params)
    return _SIGNATURES[cls]


def experts_num(module: nn.Module) -> int:
    """Experts of a transformers experts module (its ``num_experts``, else its stacked weights)."""
    experts = getattr(module, "num_experts", None)
    if experts is None:  # the stacked weights [experts, ...] say it too
        experts = next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0]
    return int(experts)


def hf_model_type(module: nn.Module) -> str | None:
    """``qwen3_moe`` for a class in ``transformers.models.qwen3_moe.modeling_qwen3_moe``."""
    # The module's own class: FSDP2's fully_shard puts a class from torch in front of it.
    own = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))
    parts = own.__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["transformers", "models"] else None


def routing_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(expert ids, routing weights)`` a transformers experts call was given.

    ``experts(hidden_states, top_k_index, top_k_weights)``; gpt_oss names them
    ``router_indices``, ``routing_weights``. Positional in every family; by name for a caller
    that passes keywords."""
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
    weights = (
        args[2] if len(args) > 2 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
    )
    return index, weights
