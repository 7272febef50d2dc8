"""Builders for the layer shapes every family shares, and a strict config reader.

Each builder turns the dimensions of one block into its matmul parameter count, so the
architecture modules only have to read the right field names of their family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_moe_metrics.flops.core import (
    AttentionLayer,
    DenseMLP,
    LinearAttentionLayer,
    MambaLayer,
    MoEMLP,
)

_MISSING = object()


class ConfigReader:
    """Reads fields of a config dict; a missing required field names the field and the model."""

    def __init__(self, config: Mapping[str, Any], model_type: str) -> None:
        self.config = config
        self.model_type = model_type

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value; ``default`` when absent or None."""
        value = self.config.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def require(self, key: str) -> Any:
        """The field's value; a clear error when it is absent."""
        value = self.config.get(key, _MISSING)
        if value is _MISSING or value is None:
            raise ValueError(
                f"{self.model_type} config has no '{key}'; it is needed for the FLOP estimate "
                "(pass the model's full config.json or PretrainedConfig)"
            )
        return value

    def first(self, *keys: str) -> Any:
        """The first present field among ``keys`` (families spell some fields differently)."""
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                return value
        raise ValueError(
            f"{self.model_type} config has none of {list(keys)}; one is needed for the FLOP "
            "estimate"
        )

    def vocab_size(self) -> int:
        """The lm_head width; an explicit error when the config has none."""
        value = self.config.get("vocab_size")
        if value is None:
            raise ValueError(
                f"{self.model_type} config has no vocab_size: pass vocab_size=<padded vocab> to "
                "get_flops_estimator to count the lm_head, or vocab_size=0 to leave it out"
            )
        return int(value)


def gqa_attention(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    output_gate: bool = False,
    window: int | None = None,
) -> AttentionLayer:
    """Grouped-query attention: q (doubled when an output gate is folded into q_proj), k, v, o."""
    q_width = num_heads * head_dim * (2 if output_gate else 1)
    kv_width = 2 * num_kv_heads * head_dim
    params = hidden * (q_width + kv_width) + num_heads * head_dim * hidden
    return AttentionLayer(params, num_heads, head_dim, head_dim, window)


def mla_attention(
    hidden: int,
    num_heads: int,
    *,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> AttentionLayer:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q (optional) and kv projections."""
    qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
        q = hidden * q_lora_rank + q_lora_rank * num_heads * qk_head_dim
    else:
        q = hidden * num_heads * qk_head_dim
    kv_down = hidden * (kv_lora_rank + qk_rope_head_dim)
    kv_up = kv_lora_rank * num_heads * (qk_nope_head_dim + v_head_dim)
    out = num_heads * v_head_dim * hidden
    return AttentionLayer(q + kv_down + kv_up + out, num_heads, qk_head_dim, v_head_dim)


def gated_delta_net(
    hidden: int,
    *,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    conv_kernel: int,
) -> LinearAttentionLayer:
    """Gated DeltaNet: q, k, v, z (output gate), beta and alpha projections, conv, out_proj."""
    key_dim = num_key_heads * key_head_dim
    value_dim = num_value_heads * value_head_dim
    in_proj = hidden * (2 * key_dim + 2 * value_dim + 2 * num_value_heads)
    out_proj = value_dim * hidden
    return LinearAttentionLayer(
        projection_params=in_proj + out_proj,
        conv_channels=2 * key_dim + value_dim,
        conv_kernel=conv_kernel,
        num_value_heads=num_value_heads,
        key_head_dim=key_head_dim,
        value_head_dim=value_head_dim,
    )


def gated_delta_net_from_config(cfg: ConfigReader, hidden: int) -> LinearAttentionLayer:
    """Gated DeltaNet from the ``linear_*`` fields Hugging Face and megatron-core share."""
    return gated_delta_net(
        hidden,
        num_key_heads=int(cfg.require("linear_num_key_heads")),
        num_value_heads=int(cfg.require("linear_num_value_heads")),
        key_head_dim=int(cfg.require("linear_key_head_dim")),
        value_head_dim=int(cfg.require("linear_value_head_dim")),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )


def mamba_mixer(
    hidden: int,
    *,
    num_heads: int,
    head_dim: int,
    num_groups: int,
    state_dim: int,
    conv_kernel: int,
) -> MambaLayer:
    """Mamba-2: in_proj to z, x, B, C, dt; depthwise conv over x, B, C; SSD scan; out_proj."""
    inner = num_heads * head_dim
    in_proj = hidden * (2 * inner + 2 * num_groups * state_dim + num_heads)
    return MambaLayer(
        projection_params=in_proj + inner * hidden,
        conv_channels=inner + 2 * num_groups * state_dim,
        conv_kernel=conv_kernel,
        num_heads=num_heads,
        head_dim=head_dim,
        state_dim=state_dim,
    )


def mlp_params(hidden: int, width: int, *, gated: bool = True) -> int:
    """Matmul weights of one MLP: gate, up, down (SwiGLU) or up, down."""
    return (3 if gated else 2) * hidden * width


def dense_mlp(hidden: int, width: int, *, gated: bool = True) -> DenseMLP:
    """A dense MLP block."""
    return DenseMLP(mlp_params(hidden, width, gated=gated))


def moe_block(
    hidden: int,
    *,
    num_experts: int,
    top_k: int,
    expert_width: int,
    shared_width: int = 0,
    shared_gate: bool = False,
    gated: bool = True,
) -> MoEMLP:
    """A routed MoE block; ``shared_width`` is the total width of the shared expert(s)."""
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    shared = mlp_params(hidden, shared_width, gated=gated) if shared_width else 0
    if shared_width and shared_gate:
        shared += hidden  # sigmoid gate: hidden -> 1
    return MoEMLP(
        router_params=hidden * num_experts,
        expert_params=mlp_params(hidden, expert_width, gated=gated),
        num_experts=num_experts,
        top_k=top_k,
        shared_params=shared,
    )


def window_from_layer_type(layer_type: str, sliding_window: int | None) -> int | None:
    """The sliding window of a Hugging Face ``layer_types`` entry (None for full attention)."""
    if layer_type == "sliding_attention":
        return int(sliding_window) if sliding_window else None
    return None
