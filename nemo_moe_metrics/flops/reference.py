"""Two widely used FLOP formulas, re-derived on a ModelShape, for comparison with ours.

Neither is used for metrics; docs/en/flops.md tabulates them next to our estimate and
explains every difference. Both return training FLOPs (forward + backward) for ``batch``
sequences of ``seq_len`` tokens.
"""

from __future__ import annotations

from nemo_moe_metrics.flops.core import (
    AttentionLayer,
    DenseMLP,
    FlopsEstimator,
    LinearAttentionLayer,
    MambaLayer,
    MoEMLP,
)


def torchtitan_style_flops(est: FlopsEstimator, seq_len: int, batch: int = 1) -> float:
    """``(6 N + 12 L H Q T) x tokens``: N = active parameters without the input embedding.

    L counts softmax-attention layers, Q is the mean of the query/key and value head dims; the
    attention term has no causal halving and ignores sliding windows; a Gated DeltaNet layer
    contributes only its parameters.
    """
    counts = est.parameter_counts()
    shape = est.shape
    n = counts.active - shape.hidden_size * shape.vocab_size  # the lookup table is not a matmul
    attention = sum(
        12 * layer.mixer.num_heads * (layer.mixer.qk_head_dim + layer.mixer.v_head_dim) / 2
        for layer in shape.layers
        if isinstance(layer.mixer, AttentionLayer)
    )
    return float((6 * n + attention * seq_len) * seq_len * batch)


def megatron_style_flops(est: FlopsEstimator, seq_len: int, batch: int = 1) -> float:
    """Megatron-LM's ``num_floating_point_operations`` terms on our shape.

    One sequence length for the whole batch (Megatron-LM up to core 0.17, and unpacked batches
    after; from core_v0.18.0 packed batches use each sequence's length), causal attention as
    ``T / 2`` keys per query
    (every layer: windows are ignored), no router GEMM, Gated DeltaNet recurrence as
    ``4 x value_heads x value_head_dim^2`` multiply-adds per token; norm terms left out. A
    Mamba-2 layer (hybrid models) is costed as in our estimate (projections, conv, scan).
    """
    shape = est.shape
    macs_per_token = float(shape.hidden_size * shape.vocab_size)
    for layer in shape.layers:
        mixer, ffn = layer.mixer, layer.ffn
        macs_per_token += 0 if mixer is None else mixer.projection_params
        if isinstance(mixer, AttentionLayer):
            width = mixer.num_heads * (mixer.qk_head_dim + mixer.v_head_dim)
            macs_per_token += width * seq_len / 2
        elif isinstance(mixer, LinearAttentionLayer):
            macs_per_token += mixer.conv_channels * mixer.conv_kernel
            macs_per_token += 4 * mixer.num_value_heads * mixer.value_head_dim**2
        elif isinstance(mixer, MambaLayer):
            macs_per_token += mixer.conv_channels * mixer.conv_kernel
            macs_per_token += 2 * mixer.num_heads * mixer.head_dim * mixer.state_dim
        if isinstance(ffn, DenseMLP):
            macs_per_token += ffn.params
        elif isinstance(ffn, MoEMLP):
            macs_per_token += ffn.top_k * ffn.expert_params + ffn.shared_params
    return 3 * 2 * macs_per_token * seq_len * batch
