"""The model decides, not the config: what a built megatron-core model really is.

A user's ``TransformerConfig`` need not describe the layers: megatron-core's ``HybridModel``
(``MambaModel`` on 0.16) takes its layer pattern as a constructor argument, not from the config,
and a GPT layer spec decides which layers hold a router whatever ``moe_layer_freq`` says.
:func:`config_as_built` reads the model given to ``PolicyMetrics.attach`` (its hybrid pattern,
the global layer numbers of the layers that hold a ``TopKRouter``) and returns a copy of the
config that carries it, so aux-loss means, per-layer keys and FLOPs follow the real layers.
Where the config says something else than the model, it raises an error naming both.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from nemo_moe_metrics.config.layer_pattern import (
    config_hybrid_pattern,
    config_moe_layer_flags,
    hybrid_layer_symbols,
    moe_flags_from_symbols,
)
from nemo_moe_metrics.megatron import compat

_DECODER_LAYER_RE = re.compile(r"(?:^|\.)decoder\.layers\.\d+$")


def _local_layers(chunks: Sequence[nn.Module]) -> tuple[set[int], set[int]]:
    """Global 0-based ids of this rank's decoder layers and of those that hold a router."""
    layers: set[int] = set()
    routers: set[int] = set()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            number = getattr(module, "layer_number", None)
            if number is None or "mtp" in name.split("."):
                continue
            if _DECODER_LAYER_RE.search(name):
                layers.add(int(number) - 1)
            elif compat.is_megatron_router(module):
                routers.add(int(number) - 1)
    return layers, routers


def _moe_positions(flags: Sequence[int]) -> list[int]:
    return [i for i, f in enumerate(flags) if f]


def config_as_built(chunks: nn.Module | Sequence[nn.Module], config: Any) -> Any:
    """A copy of the megatron ``config`` carrying the layer layout of the model ``chunks``.

    A hybrid model's own pattern is set on the copy as ``hybrid_layer_pattern`` (what
    :func:`~nemo_moe_metrics.config.layer_pattern.config_hybrid_pattern` reads); a GPT model's
    routers are checked against ``moe_layer_freq``. The config is returned unchanged when the chunks
    are no megatron model (no router and no hybrid pattern). Raises ``ValueError`` where the config
    and the model disagree (pattern, layer count, MoE layers), naming both.
    """
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    pattern = next(
        (p for p in (compat.model_hybrid_pattern(c) for c in chunks) if p is not None), None
    )
    layers, routers = _local_layers(chunks)
    if pattern is None and not routers:
        return config
    num_layers = int(config.num_layers)
    if routers and not getattr(config, "num_moe_experts", None):
        raise ValueError(
            f"the model has MoE routers in layers {sorted(routers)} (global, 0-based) but the "
            "config given to attach has no num_moe_experts; pass the model's own TransformerConfig"
        )
    if pattern is not None:
        symbols = hybrid_layer_symbols(pattern)
        said = config_hybrid_pattern(config)
        if said is not None and hybrid_layer_symbols(said) != symbols:
            raise ValueError(
                f"the config's hybrid layer pattern {said!r} is not the model's {pattern!r}; "
                "the model decides: drop the pattern from the config or pass the model's own"
            )
        if len(symbols) != num_layers:
            raise ValueError(
                f"the model's hybrid layer pattern {pattern!r} has {len(symbols)} layers but the "
                f"config has num_layers={num_layers}; pass the model's own TransformerConfig"
            )
        moe = moe_flags_from_symbols(symbols)
        where = f"the model's hybrid layer pattern {pattern!r}"
    else:
        moe = config_moe_layer_flags(config)
        where = f"the config's moe_layer_freq={config.moe_layer_freq!r}"
    expected = {i for i in layers if i < num_layers and moe[i]}
    found = {i for i in routers if i < num_layers}
    if found != expected or any(i >= num_layers for i in layers):
        raise ValueError(
            f"{where} makes layers {_moe_positions(moe)} MoE (global, 0-based), but this rank's "
            f"decoder layers {sorted(layers)} hold routers in {sorted(found)}; the model decides: "
            "pass the TransformerConfig the model was built with (for a GPT model, moe_layer_freq "
            "is honoured by get_gpt_decoder_block_spec, not by get_gpt_layer_local_spec)"
        )
    if pattern is None or config_hybrid_pattern(config) == pattern:
        return config
    built = copy.copy(config)
    # TransformerConfig has no pattern field: an attribute, as megatron/model.py sets it.
    built.hybrid_layer_pattern = pattern
    return built
