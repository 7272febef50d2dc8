"""Which decoder layers are MoE: the one answer, for a recipe, a megatron config or a built model.

A model names its MoE layers one of two ways, and every reader asks here (the recipe's
validation in ``config.py``, the aux-loss metrics in ``moe/aux_loss.py``, the check of a built
model in ``megatron/layout.py``, megatron's own report in ``megatron/compat``, the FLOP formulas):

- megatron-core's hybrid layer pattern, one symbol per layer (``*`` attention, ``-`` dense MLP,
  ``E`` MoE, ``M`` Mamba, ``G`` Gated DeltaNet, ``D`` DeepSeek attention, ``+`` MLA; ``|`` a
  pipeline-stage cut), carried by a config as ``hybrid_layer_pattern`` (megatron-core 0.19,
  Megatron-Bridge's hybrid providers) or ``hybrid_override_pattern`` (0.16);
- otherwise ``moe_layer_freq`` as megatron-core's GPT decoder reads it: an int ``n`` (every
  ``n``-th layer from the first is MoE) or one 0/1 entry per layer.

Nothing here imports megatron or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# megatron-core's hybrid layer symbols (models/hybrid/hybrid_layer_allocation.Symbols).
MAMBA_SYMBOL = "M"
GDN_SYMBOL = "G"
ATTENTION_SYMBOL = "*"
DS_ATTENTION_SYMBOL = "D"
MLA_SYMBOL = "+"
MLP_SYMBOL = "-"
MOE_SYMBOL = "E"
PIPE_SYMBOL = "|"
MTP_SEPARATOR = "/"
LAYER_SYMBOLS = (
    MAMBA_SYMBOL,
    GDN_SYMBOL,
    ATTENTION_SYMBOL,
    DS_ATTENTION_SYMBOL,
    MLA_SYMBOL,
    MLP_SYMBOL,
    MOE_SYMBOL,
)


def hybrid_layer_symbols(pattern: str) -> list[str]:
    """One symbol per decoder layer of a hybrid pattern; ``|`` (pipeline cuts) is dropped.

    Layer ``i`` of the returned list is the hybrid stack's layer ``i`` (megatron's
    ``layer_number = i + 1``). Multi-token-prediction parts (after ``/``) are rejected.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid layer pattern must be a non-empty string, got {pattern!r}")
    if MTP_SEPARATOR in pattern:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has a multi-token-prediction part ('/'), which "
            "nemo_moe_metrics does not support for hybrid models; drop the '/...' suffix"
        )
    symbols = [s for s in pattern if s != PIPE_SYMBOL]
    bad = sorted({s for s in symbols if s not in LAYER_SYMBOLS})
    if bad or not symbols:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has unknown symbols {bad}; use M (Mamba), "
            "G (Gated DeltaNet), * (attention), D (DeepSeek attention), + (MLA), - (MLP), "
            "E (MoE) and | (pipeline stage boundary)"
        )
    return symbols


def config_hybrid_pattern(config: Any) -> str | None:
    """The hybrid layer pattern a config carries, if any.

    Read from ``hybrid_layer_pattern`` (megatron-core 0.19 naming, Megatron-Bridge's hybrid
    providers) or ``hybrid_override_pattern`` (0.16 and older providers); works on config
    objects and plain dicts. A plain ``TransformerConfig`` has neither: set the attribute on it.
    """
    for key in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value:
            return str(value)
    return None


def config_hybrid_symbols(config: Any) -> list[str] | None:
    """:func:`hybrid_layer_symbols` of the config's pattern, or None for a non-hybrid config."""
    pattern = config_hybrid_pattern(config)
    return None if pattern is None else hybrid_layer_symbols(pattern)


def moe_flags_from_symbols(symbols: Sequence[str]) -> list[int]:
    """One 0/1 entry per layer of a hybrid pattern's symbols, 1 where the layer is MoE (``E``)."""
    return [1 if s == MOE_SYMBOL else 0 for s in symbols]


def moe_layer_flags(num_layers: int, moe_layer_freq: Any, hybrid_pattern: str | None) -> list[int]:
    """One 0/1 entry per decoder layer, 1 where the layer is MoE.

    From ``hybrid_pattern`` (``E`` = MoE) when given, else from ``moe_layer_freq`` as
    megatron-core's GPT decoder reads it. Raises ``ValueError`` naming what is wrong (a pattern
    of another length, a ``moe_layer_freq`` that is neither a positive int nor 0/1 per layer).
    """
    if hybrid_pattern is not None:
        symbols = hybrid_layer_symbols(hybrid_pattern)
        if len(symbols) != num_layers:
            raise ValueError(
                f"the hybrid layer pattern has {len(symbols)} layers but num_layers is "
                f"{num_layers}; pass the model's own config"
            )
        return moe_flags_from_symbols(symbols)
    freq = moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise ValueError(
            f"moe_layer_freq={freq!r} is neither an int nor a list of 0/1 per layer; "
            "pass e.g. 1 (every layer MoE), 2 (every other layer) or [0, 1, 1, 1]"
        )
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq} must be >= 1 (1 = every layer is MoE)")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers:
        raise ValueError(
            f"moe_layer_freq has {len(freq)} entries but num_layers is {num_layers}; "
            "give one 0/1 entry per decoder layer"
        )
    return [int(v) for v in freq]


def config_moe_layer_flags(config: Any) -> list[int]:
    """:func:`moe_layer_flags` of a megatron ``TransformerConfig`` (or a config object with
    ``num_layers``, ``moe_layer_freq`` and perhaps a hybrid pattern)."""
    pattern = config_hybrid_pattern(config)
    freq = None if pattern is not None else config.moe_layer_freq
    return moe_layer_flags(config.num_layers, freq, pattern)
