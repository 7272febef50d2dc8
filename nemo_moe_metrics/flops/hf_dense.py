"""Dense Hugging Face decoders: llama, mistral, qwen2, qwen3."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.flops.components import (
    ConfigReader,
    dense_mlp,
    gqa_attention,
    window_from_layer_type,
)
from nemo_moe_metrics.flops.core import AttentionLayer, FlopsEstimator, Layer, ModelShape


def hf_attention(cfg: ConfigReader, layer: int, *, output_gate: bool = False) -> AttentionLayer:
    """GQA attention of layer ``layer``; ``head_dim`` is read, never assumed hidden/heads."""
    hidden = int(cfg.require("hidden_size"))
    heads = int(cfg.require("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim", hidden // heads))
    return gqa_attention(
        hidden, heads, kv_heads, head_dim, output_gate=output_gate, window=layer_window(cfg, layer)
    )


def layer_window(cfg: ConfigReader, layer: int) -> int | None:
    """The sliding window of a layer, following each family's config conventions."""
    sliding_window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return window_from_layer_type(layer_types[layer], sliding_window)
    if sliding_window is None:
        return None
    model_type = cfg.model_type
    if model_type in ("qwen2", "qwen3"):
        # No layer_types in the dict: the config class derives them like this.
        if not cfg.get("use_sliding_window", False):
            return None
        return int(sliding_window) if layer >= int(cfg.get("max_window_layers", 28)) else None
    if model_type == "qwen3_moe" and not cfg.get("use_sliding_window", False):
        return None
    if model_type == "qwen2_moe":
        # Qwen2MoeConfig: even layers below max_window_layers slide, when use_sliding_window.
        if not cfg.get("use_sliding_window", False):
            return None
        below = layer < int(cfg.get("max_window_layers", 28))
        return int(sliding_window) if layer % 2 == 0 and below else None
    # mistral, mixtral, qwen3_moe: one window for every layer when set.
    return int(sliding_window)


def num_layers(cfg: ConfigReader) -> int:
    """Decoder layer count; also checks ``layer_types`` has one entry per layer."""
    n = int(cfg.require("num_hidden_layers"))
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != n:
        raise ValueError(
            f"{cfg.model_type}: layer_types has {len(layer_types)} entries for "
            f"num_hidden_layers={n}"
        )
    return n


def tied(cfg: ConfigReader, default: bool = False) -> bool:
    """Whether the lm_head shares the embedding matrix (parameter counts only)."""
    return bool(cfg.get("tie_word_embeddings", default))


def dense_decoder(config: Mapping[str, Any]) -> FlopsEstimator:
    """Factory for llama, mistral, qwen2, qwen3: GQA attention + SwiGLU MLP in every layer."""
    cfg = ConfigReader(config, str(config.get("model_type")))
    hidden = int(cfg.require("hidden_size"))
    width = int(cfg.require("intermediate_size"))
    layers = tuple(
        Layer(hf_attention(cfg, i), dense_mlp(hidden, width)) for i in range(num_layers(cfg))
    )
    return FlopsEstimator(ModelShape(cfg.model_type, hidden, layers, cfg.vocab_size(), tied(cfg)))
