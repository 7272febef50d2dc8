"""torchtitan (0.3.0): tiny models of its MoE families for CPU runs, tests and the example.

A torchtitan model needs no integration code of its own: ``PolicyMetrics.attach(model,
model_config)`` takes the model and its torchtitan config (``DeepSeekV3Model.Config``,
``Qwen3Model.Config``), counts its ``TokenChoiceTopKRouter`` outputs, reads its
``expert_bias_E`` buffers and estimates FLOPs from the config (``adapters.torchtitan``,
``flops.torchtitan``). This module builds the small models that show it on a CPU:

- :func:`tiny_config` builds a DeepSeek-V3 (MLA, a dense first layer, shared + routed experts,
  sigmoid routing) or Qwen3 MoE (GQA, softmax routing) config with torchtitan's own layer
  builders, a few layers wide enough for ``torch._grouped_mm`` (which torchtitan runs in bf16;
  on a CPU it needs 16-byte strides, so widths are multiples of 8);
- :func:`use_sdpa_attention` swaps flex attention (no backward on CPU in torch 2.13) for
  torchtitan's ``ScaledDotProductAttention`` (causal, no masks);
- :func:`build_model` builds on the meta device and initialises on the target one, as
  torchtitan's trainer does;
- :func:`use_cpu_device_mesh`: torchtitan picks ``"cuda"`` as its device type when no
  accelerator is found, so its ``ParallelDims`` cannot build a gloo mesh on a CPU; this points
  its device type at ``"cpu"`` (only when CUDA is not available).

Imports torchtitan lazily (the ``torchtitan`` extra).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from nemo_moe_metrics.runtime.extras import require

Family = Literal["deepseek_v3", "qwen3_moe"]
FAMILIES: tuple[str, ...] = ("deepseek_v3", "qwen3_moe")


def tiny_config(
    family: Family,
    *,
    layers: int = 3,
    dim: int = 64,
    experts: int = 8,
    top_k: int = 2,
    vocab_size: int = 256,
    max_seq_len: int = 256,
    load_balance_coeff: float | None = 1e-3,
) -> Any:
    """A tiny torchtitan model config of ``family`` built with torchtitan's layer builders."""
    require("torchtitan", "torchtitan", "a torchtitan model")
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    if family == "deepseek_v3":
        from torchtitan.models import deepseek_v3 as ds
        from torchtitan.models.common import ComplexRoPE

        rope_dim = 8
        blocks = ds._build_dsv3_layers(
            n_layers=layers,
            n_dense_layers=1,
            dim=dim,
            n_heads=4,
            q_lora_rank=0,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=rope_dim,
            v_head_dim=16,
            mscale=0.70,
            dense_hidden_dim=2 * dim,
            moe_hidden_dim=dim // 2,
            num_experts=experts,
            num_shared_experts=1,
            router_top_k=top_k,
            router_score_func="sigmoid",
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=max_seq_len, theta=10000.0),
        )
        model_cls, norm_init, emb_init = ds.DeepSeekV3Model, ds._NORM_INIT, ds._EMBEDDING_INIT
        lm_init = ds._output_linear_init(dim)
    elif family == "qwen3_moe":
        from torchtitan.models import qwen3 as qw
        from torchtitan.models.common import CosSinRoPE

        head_dim = 16
        blocks = qw._build_qwen3_moe_layers(
            n_layers=layers,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            moe_hidden_dim=dim // 2,
            num_experts=experts,
            top_k=top_k,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=1000000.0),
        )
        model_cls, norm_init, emb_init = qw.Qwen3Model, qw._NORM_INIT, qw._EMBEDDING_INIT
        lm_init = qw._LINEAR_INIT
    else:
        raise ValueError(f"unknown torchtitan family {family!r}; known: {FAMILIES}")
    for block in blocks:
        if block.moe is not None:
            block.moe.load_balance_coeff = load_balance_coeff
    return model_cls.Config(
        vocab_size=vocab_size,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=emb_init
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=lm_init),
        layers=blocks,
    )


def use_sdpa_attention(config: Any) -> Any:
    """Every layer's inner attention becomes ``ScaledDotProductAttention`` (causal); in place."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for block in config.layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def build_model(config: Any, *, device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """Build on the meta device, materialise on ``device`` and initialise (torchtitan's way)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def use_cpu_device_mesh() -> None:
    """Let torchtitan's ``ParallelDims`` build CPU (gloo) meshes; a no-op when CUDA is there."""
    if torch.cuda.is_available():
        return
    require("torchtitan", "torchtitan", "a torchtitan device mesh")
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils

    parallel_dims.device_type = "cpu"
    dist_utils.device_type = "cpu"
