"""torchtitan model family adapter: what the worker reads from a torchtitan model config.

torchtitan (0.3.0) builds a model from a nested ``Decoder.Config`` (``DeepSeekV3Model.Config``,
``Qwen3Model.Config``, ...) whose ``layers`` list holds one block config per layer; a block
with ``moe`` set is an MoE layer (``MoE.Config``: ``num_experts``, ``router.top_k``,
``load_balance_coeff``). The routers (``TokenChoiceTopKRouter``) are counted by the same
collector as every other family (``moe.hooks``); their expert ids are the routing after the
aux-loss-free bias and any group limit. Nothing here imports torchtitan.
"""

from __future__ import annotations

from typing import Any


def is_torchtitan_config(config: Any) -> bool:
    """A torchtitan model config (a dataclass from the torchtitan package with ``layers``)."""
    module = type(config).__module__ or ""
    return module.split(".")[0] == "torchtitan" and isinstance(
        getattr(config, "layers", None), list | tuple
    )


def moe_layer_configs(config: Any) -> list[tuple[int, Any]]:
    """``(layer index, MoE.Config)`` of every MoE layer of the main decoder (MTP excluded)."""
    return [
        (i, block.moe)
        for i, block in enumerate(config.layers)
        if getattr(block, "moe", None) is not None
    ]


def torchtitan_model_facts(config: Any) -> tuple[int, int, bool]:
    """``(routed experts per MoE layer, decoder layers, expert bias on)`` of a torchtitan config."""
    moes = moe_layer_configs(config)
    experts = {int(moe.num_experts) for _, moe in moes}
    if len(experts) > 1:
        raise ValueError(f"torchtitan config: MoE layers disagree on num_experts {sorted(experts)}")
    bias = any(getattr(moe, "load_balance_coeff", None) is not None for _, moe in moes)
    return (experts.pop() if experts else 0), len(config.layers), bias
