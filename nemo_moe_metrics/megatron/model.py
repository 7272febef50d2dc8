"""Build a real megatron-core model (GPTModel or hybrid) with MoE layers from a recipe's model
section."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_moe_metrics.config import MegatronConfig, ModelConfig
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.megatron.cpu_shims import apply_cpu_shims, cuda_available
from nemo_moe_metrics.runtime.extras import require


def init_distributed(
    megatron_cfg: MegatronConfig, seed: int = 1234, timeout_s: float = 120.0
) -> None:
    """Join (or start a one-rank) process group and initialise megatron-core's parallel state.

    Under torchrun the environment names the world; without it a single-rank group is made, so
    the same code runs in a plain ``python`` process. CPU uses gloo, CUDA uses NCCL.
    """
    require("megatron.core", "megatron", "the megatron-core policy worker")
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_shims()
    if not dist.is_initialized():
        backend = "nccl" if cuda_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=timeout_s)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            # One rank meets no one: an in-memory store, no TCP port another process can take.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    world = dist.get_world_size()
    model_parallel = megatron_cfg.pipeline_model_parallel_size * megatron_cfg.context_parallel_size
    if world % model_parallel or world % megatron_cfg.expert_model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by the parallel layout "
            f"(pipeline {megatron_cfg.pipeline_model_parallel_size} x context "
            f"{megatron_cfg.context_parallel_size}, expert "
            f"{megatron_cfg.expert_model_parallel_size}); "
            "change --nproc or the *_parallel_size settings"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        context_parallel_size=megatron_cfg.context_parallel_size,
        expert_model_parallel_size=megatron_cfg.expert_model_parallel_size,
        # Fractional minutes: megatron's groups get the same timeout as the world group
        # (int minutes turned 5 s into 60 s, so a rank missing a collective stalled the rest).
        distributed_timeout_minutes=timeout_s / 60,
    )
    if cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def build_transformer_config(model: ModelConfig, megatron_cfg: MegatronConfig):
    """The megatron-core TransformerConfig for the recipe's model and parallel layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            # A hybrid model's E symbols, as the 0/1 list megatron's own reporting reads.
            moe_layer_freq=(
                model.moe_layer_pattern()
                if model.hybrid_layer_pattern is not None
                else model.moe_layer_freq
            ),
            moe_router_load_balancing_type=model.moe_router_load_balancing_type,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_z_loss_coeff=model.moe_z_loss_coeff,
            moe_expert_capacity_factor=model.moe_expert_capacity_factor,
            # megatron accepts the expert bias only with sigmoid router scores.
            **(
                dict(
                    moe_router_enable_expert_bias=True,
                    moe_router_score_function="sigmoid",
                    moe_router_bias_update_rate=model.moe_router_bias_update_rate,
                )
                if model.moe_router_enable_expert_bias
                else {}
            ),
            moe_token_dispatcher_type="allgather" if not cuda_available() else "alltoall",
            moe_grouped_gemm=False,
        )
        moe.update(compat.router_replay_kwargs(megatron_cfg.moe_enable_routing_replay))
    recompute: dict = {}
    if megatron_cfg.recompute_granularity == "full":
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif megatron_cfg.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not cuda_available(),
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        expert_model_parallel_size=megatron_cfg.expert_model_parallel_size,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        context_parallel_size=megatron_cfg.context_parallel_size,
        **moe,
        **recompute,
    )
    if model.hybrid_layer_pattern is not None:
        # TransformerConfig has no pattern field; carried as an attribute under the name
        # megatron-core 0.19 and Megatron-Bridge's hybrid providers use, so the aux-loss and
        # FLOP code (layer_pattern.config_hybrid_pattern) can read it from the config alone.
        config.hybrid_layer_pattern = model.hybrid_layer_pattern
    return config


def build_model(model: ModelConfig, megatron_cfg: MegatronConfig, vp_stage: int | None = None):
    """The recipe's model: a hybrid model when ``hybrid_layer_pattern`` is set, else a GPTModel."""
    if model.hybrid_layer_pattern is not None:
        return build_hybrid_model(model, megatron_cfg)
    return build_gpt_model(model, megatron_cfg, vp_stage=vp_stage)


def build_hybrid_model(model: ModelConfig, megatron_cfg: MegatronConfig):
    """A megatron-core hybrid model (HybridModel; MambaModel on 0.16) from the recipe's pattern.

    Layer ``i`` of the pattern is the stack's layer ``i``: a router in an ``E`` layer has
    ``layer_number = i + 1`` and reports as global layer ``i``. Call init_distributed first.
    """
    if model.hybrid_layer_pattern is None:
        raise ValueError("build_hybrid_model needs policy.model.hybrid_layer_pattern")
    if megatron_cfg.pipeline_model_parallel_size != 1:
        raise ValueError(
            "the reference hybrid model runs without pipeline parallelism: set "
            "policy.megatron_cfg.pipeline_model_parallel_size=1"
        )
    apply_cpu_shims()
    config = build_transformer_config(model, megatron_cfg)
    hybrid = compat.build_hybrid_model(
        config,
        model.hybrid_layer_pattern,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
    )
    if cuda_available():
        hybrid = hybrid.cuda()
    return hybrid


def build_gpt_model(model: ModelConfig, megatron_cfg: MegatronConfig, vp_stage: int | None = None):
    """A megatron-core GPTModel (this pipeline stage's layers) with RoPE and MoE layers.

    Call init_distributed first. ``moe_layer_freq`` patterns need the decoder block spec, which
    builds dense and MoE layers as the pattern says.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    apply_cpu_shims()
    config = build_transformer_config(model, megatron_cfg)
    if model.is_moe:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if cuda_available():
        gpt = gpt.cuda()
    return gpt


def causal_attention_mask(seq_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[1, 1, s, s]`` mask, True where attention is masked (megatron-core convention).

    Passed explicitly because megatron-core builds its default mask on "cuda".
    """
    return torch.triu(
        torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1
    ).view(1, 1, seq_length, seq_length)
