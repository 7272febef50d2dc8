"""megatron-core ``TransformerConfig`` (and ``MLATransformerConfig``) as built by GPTModel.

Reads: GQA (``num_query_groups``, ``kv_channels``), ``attention_output_gate``, MLA,
sliding windows (``window_size``, ``window_attn_skip_freq``), Gated DeltaNet
(``experimental_attention_variant="gated_delta_net"``, ``linear_attention_freq``), SwiGLU
(``gated_linear_unit``), MoE (``moe_layer_freq``, ``moe_ffn_hidden_size``,
``moe_shared_expert_intermediate_size``, ``moe_shared_expert_gate``). Multi-token prediction
(``mtp_num_layers``): each MTP layer is the last decoder layer's kind (megatron builds its
transformer layer from the last layer's spec) plus its ``2h -> h`` projection and one more
lm_head, as Megatron-LM's ``num_floating_point_operations`` counts it (its two norms, ``3h``
per token, are not: norms are never counted here).

Hybrid models (megatron-core ``HybridModel``, ``MambaModel``): when the config carries a layer
pattern (``hybrid_layer_pattern`` or ``hybrid_override_pattern``), each symbol is one layer costed
by its component: ``*`` attention (as above), ``+`` MLA, ``G`` Gated DeltaNet (``linear_*``
fields), ``M`` Mamba-2 (``mamba_*`` fields), ``-`` dense MLP, ``E`` MoE block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.config import layer_pattern as lp
from nemo_moe_metrics.config.layer_pattern import (
    config_hybrid_pattern,
    config_hybrid_symbols,
    moe_layer_flags,
)
from nemo_moe_metrics.flops.components import (
    ConfigReader,
    dense_mlp,
    gated_delta_net_from_config,
    gqa_attention,
    mamba_mixer,
    mla_attention,
    moe_block,
)
from nemo_moe_metrics.flops.core import FlopsEstimator, Layer, ModelShape

MEGATRON_MODEL_TYPE = "megatron_gpt"


def is_megatron_config(config: Any) -> bool:
    """True for a megatron-core TransformerConfig (or subclass) instance, without importing it."""
    return dataclasses.is_dataclass(config) and any(
        cls.__name__ == "TransformerConfig" and cls.__module__.startswith("megatron.core")
        for cls in type(config).__mro__
    )


def megatron_config_to_dict(config: Any, vocab_size: int | None) -> dict[str, Any]:
    """The config's fields as a plain dict, plus ``vocab_size`` and ``model_type``.

    A TransformerConfig has no vocabulary: ``vocab_size`` must be given explicitly (0 leaves
    the output layer out on purpose).
    """
    if vocab_size is None:
        raise ValueError(
            "a megatron-core TransformerConfig has no vocabulary size: pass "
            "vocab_size=<padded vocab size> to get_flops_estimator to count the output layer, "
            "or vocab_size=0 to leave the lm_head out deliberately"
        )
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    # A plain TransformerConfig carries a hybrid pattern as an attribute, not a field.
    pattern = config_hybrid_pattern(config)
    if pattern is not None:
        out["hybrid_layer_pattern"] = pattern
    out["vocab_size"] = int(vocab_size)
    out["model_type"] = MEGATRON_MODEL_TYPE
    return out


def _pattern(value: Any, num_layers: int, name: str, *, int_rule) -> list[int]:
    if isinstance(value, int):
        return [int_rule(i, value) for i in range(num_layers)]
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(f"{name} has {len(value)} entries but num_layers is {num_layers}")
        return [int(v) for v in value]
    raise ValueError(
        f"{name}={value!r} is not an int or a list; pass the evaluated per-layer pattern"
    )


def megatron_gpt(config: Mapping[str, Any]) -> FlopsEstimator:
    """Factory for a megatron-core GPT model described by TransformerConfig fields."""
    cfg = ConfigReader(config, MEGATRON_MODEL_TYPE)
    hidden = int(cfg.require("hidden_size"))
    n = int(cfg.require("num_layers"))
    heads = int(cfg.require("num_attention_heads"))
    gated = bool(cfg.get("gated_linear_unit", False))

    symbols = config_hybrid_symbols(config)
    if symbols is not None and len(symbols) != n:
        raise ValueError(
            f"the hybrid layer pattern has {len(symbols)} layers but num_layers is {n}; "
            "pass the model's own config"
        )

    # Token mixers.
    if cfg.get("multi_latent_attention", False):
        attention = [_mla(cfg, hidden, heads)] * n
    else:
        groups = int(cfg.get("num_query_groups", heads))
        kv = int(cfg.get("kv_channels", hidden // heads))
        window = cfg.get("window_size")
        skip = cfg.get("window_attn_skip_freq")
        attention = []
        for layer_number in range(1, n + 1):
            layer_window = None
            if window is not None and _is_window_layer(skip, layer_number):
                left, right = (int(window[0]), int(window[1]))
                if right not in (0, -1):
                    raise ValueError(f"window_size={window}: only causal windows are supported")
                # (left, 0): a query sees itself and `left` earlier tokens; -1 is unbounded.
                layer_window = None if left < 0 else left + 1
            attention.append(
                gqa_attention(
                    hidden,
                    heads,
                    groups,
                    kv,
                    output_gate=bool(cfg.get("attention_output_gate", False)),
                    window=layer_window,
                )
            )
    if symbols is not None:
        if cfg.get("mtp_num_layers"):
            raise ValueError(
                "mtp_num_layers with a hybrid layer pattern has no FLOP formula here (the "
                "pattern's MTP blocks are their own layer patterns); register your own factory "
                "with register_flops_estimator('megatron_gpt', ...)"
            )
        return _hybrid_estimator(cfg, symbols, attention, hidden, heads, gated)
    variant = cfg.get("experimental_attention_variant")
    if variant == "gated_delta_net":
        linear = _pattern(
            cfg.require("linear_attention_freq"),
            n,
            "linear_attention_freq",
            int_rule=lambda i, f: 0 if (i + 1) % f == 0 else 1,
        )
        gdn = gated_delta_net_from_config(cfg, hidden)
        mixers = [gdn if linear[i] else attention[i] for i in range(n)]
    elif variant is None:
        mixers = attention
    else:
        raise ValueError(
            f"experimental_attention_variant={variant!r} has no FLOP formula here; register "
            "your own factory with register_flops_estimator('megatron_gpt', ...)"
        )

    # Feed-forward blocks.
    moe = _moe(cfg, hidden, gated)
    is_moe = [0] * n if moe is None else moe_layer_flags(n, cfg.get("moe_layer_freq", 1), None)
    dense = dense_mlp(hidden, int(cfg.require("ffn_hidden_size")), gated=gated)
    layers = tuple(Layer(mixers[i], moe if is_moe[i] else dense) for i in range(n))
    mtp = (layers[-1],) * int(cfg.get("mtp_num_layers") or 0)
    return _estimator(cfg, hidden, layers, mtp)


def _estimator(
    cfg: ConfigReader, hidden: int, layers: tuple[Layer, ...], mtp: tuple[Layer, ...] = ()
) -> FlopsEstimator:
    return FlopsEstimator(
        ModelShape(
            MEGATRON_MODEL_TYPE,
            hidden,
            layers,
            cfg.vocab_size(),
            tied_embeddings=bool(cfg.get("share_embeddings_and_output_weights", False)),
            mtp_layers=mtp,
        )
    )


def _mla(cfg: ConfigReader, hidden: int, heads: int) -> Any:
    return mla_attention(
        hidden,
        heads,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg.require("kv_lora_rank")),
        qk_nope_head_dim=int(cfg.require("qk_head_dim")),
        qk_rope_head_dim=int(cfg.require("qk_pos_emb_head_dim")),
        v_head_dim=int(cfg.require("v_head_dim")),
    )


def _moe(cfg: ConfigReader, hidden: int, gated: bool) -> Any:
    experts = cfg.get("num_moe_experts")
    if not experts:
        return None
    return moe_block(
        hidden,
        num_experts=int(experts),
        top_k=int(cfg.require("moe_router_topk")),
        expert_width=int(cfg.first("moe_ffn_hidden_size", "ffn_hidden_size")),
        shared_width=int(cfg.get("moe_shared_expert_intermediate_size", 0)),
        shared_gate=bool(cfg.get("moe_shared_expert_gate", False)),
        gated=gated,
    )


def _mamba(cfg: ConfigReader, hidden: int) -> Any:
    # megatron-core's MambaMixer: expand 2, conv kernel 4 (its defaults; the specs keep them).
    head_dim = int(cfg.require("mamba_head_dim"))
    heads = cfg.get("mamba_num_heads") or (2 * hidden) // head_dim
    return mamba_mixer(
        hidden,
        num_heads=int(heads),
        head_dim=head_dim,
        num_groups=int(cfg.require("mamba_num_groups")),
        state_dim=int(cfg.require("mamba_state_dim")),
        conv_kernel=4,
    )


def _hybrid_estimator(
    cfg: ConfigReader,
    symbols: list[str],
    attention: list[Any],
    hidden: int,
    heads: int,
    gated: bool,
) -> FlopsEstimator:
    """One layer per pattern symbol, each costed by its own component."""
    layers = []
    for i, symbol in enumerate(symbols):
        if symbol == lp.ATTENTION_SYMBOL:
            layers.append(Layer(attention[i], None))
        elif symbol == lp.MLA_SYMBOL:
            layers.append(Layer(_mla(cfg, hidden, heads), None))
        elif symbol == lp.GDN_SYMBOL:
            layers.append(Layer(gated_delta_net_from_config(cfg, hidden), None))
        elif symbol == lp.MAMBA_SYMBOL:
            layers.append(Layer(_mamba(cfg, hidden), None))
        elif symbol == lp.MLP_SYMBOL:
            layers.append(
                Layer(None, dense_mlp(hidden, int(cfg.require("ffn_hidden_size")), gated=gated))
            )
        elif symbol == lp.MOE_SYMBOL:
            moe = _moe(cfg, hidden, gated)
            if moe is None:
                raise ValueError(
                    f"hybrid layer {i} is MoE ('E') but the config has no num_moe_experts"
                )
            layers.append(Layer(None, moe))
        else:
            raise ValueError(
                f"hybrid layer {i} is {symbol!r} (DeepSeek sparse attention), which has no FLOP "
                "formula here; register your own factory with "
                "register_flops_estimator('megatron_gpt', ...)"
            )
    return _estimator(cfg, hidden, tuple(layers))


def _is_window_layer(skip_freq: Any, layer_number: int) -> bool:
    # megatron-core's rule (transformer/utils.py): 1-based layer numbers.
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    return bool(skip_freq[layer_number - 1])
