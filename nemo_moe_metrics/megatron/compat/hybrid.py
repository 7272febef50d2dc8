"""megatron-core's hybrid models on either release: the pattern a built model holds, the
release's model and stack classes, and a hybrid stack built from local (non-Transformer-Engine)
GPT modules. Release differences: see :mod:`nemo_moe_metrics.megatron.compat`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from nemo_moe_metrics.config.layer_pattern import (
    ATTENTION_SYMBOL,
    MLP_SYMBOL,
    MOE_SYMBOL,
    hybrid_layer_symbols,
)

if TYPE_CHECKING:  # torch is imported where used: importing the adapter stays cheap
    import torch


def model_hybrid_pattern(model: Any) -> str | None:
    """The hybrid layer pattern a built model holds, or None for a non-hybrid model.

    0.19's ``HybridModel`` keeps it as ``hybrid_layer_pattern`` (also when it was given as the
    deprecated ``hybrid_override_pattern`` or ratios), 0.16's ``MambaModel`` as
    ``hybrid_override_pattern``; 0.16 built from ratios leaves that None and only its stack's
    ``layer_type_list`` has the layers (the whole model's only without pipeline parallelism).
    Wrappers (DDP, ``Float16Module``) are looked through: any submodule may hold it.
    """
    stack_layers = None
    for module in model.modules():
        for key in ("hybrid_layer_pattern", "hybrid_override_pattern"):
            value = getattr(module, key, None)
            if isinstance(value, str) and value:
                return value
        types = getattr(module, "layer_type_list", None)
        single_stage = getattr(module, "config", None)
        single_stage = getattr(single_stage, "pipeline_model_parallel_size", 1) == 1
        if stack_layers is None and isinstance(types, list) and types and single_stage:
            stack_layers = "".join(str(t) for t in types)
    return stack_layers


def hybrid_model_class() -> tuple[type, str, str]:
    """``(model class, spec keyword, pattern keyword)`` of this release's hybrid model.

    0.19: ``HybridModel(hybrid_stack_spec=..., hybrid_layer_pattern=...)``; 0.16:
    ``MambaModel(mamba_stack_spec=..., hybrid_override_pattern=...)``.
    """
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel

        return MambaModel, "mamba_stack_spec", "hybrid_override_pattern"
    return HybridModel, "hybrid_stack_spec", "hybrid_layer_pattern"


def _stack_classes() -> tuple[type, type]:
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    except ImportError:
        from megatron.core.ssm.mamba_block import MambaStack as HybridStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as HybridStackSubmodules
    return HybridStack, HybridStackSubmodules


def locally_supported_symbols() -> set[str]:
    """Hybrid symbols :func:`local_hybrid_stack_spec` builds: attention, MLP and MoE layers.

    Mamba (``M``) needs the ``mamba-ssm`` CUDA kernels, Gated DeltaNet (``G``) the
    ``flash-linear-attention`` Triton kernels, and megatron-core builds both (and ``D``, ``+``)
    only from Transformer Engine specs.
    """
    return {ATTENTION_SYMBOL, MLP_SYMBOL, MOE_SYMBOL}


_LOCAL_STACK: dict[str, type] = {}


def _local_final_norm_stack() -> type:
    """The release's hybrid stack with the final norm built from megatron's local norm.

    Both ``HybridStack`` (0.19) and ``MambaStack`` (0.16) create ``TENorm`` for their final
    layer norm, which needs Transformer Engine. This subclass builds the stack without it and
    adds megatron-core's ``WrappedTorchNorm`` under the same name (``final_norm``).
    """
    if "cls" not in _LOCAL_STACK:
        stack_cls, _ = _stack_classes()

        def __init__(self, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
            stack_cls.__init__(self, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                from megatron.core.transformer.torch_norm import WrappedTorchNorm

                self.final_norm = WrappedTorchNorm(
                    config=self.config,
                    hidden_size=self.config.hidden_size,
                    eps=self.config.layernorm_epsilon,
                )

        _LOCAL_STACK["cls"] = type(
            f"Local{stack_cls.__name__}",
            (stack_cls,),
            {"__init__": __init__, "__module__": __name__},
        )
    return _LOCAL_STACK["cls"]


def local_hybrid_stack_spec(num_experts: int | None) -> Any:
    """A hybrid stack spec from megatron-core's local (non-TE) GPT modules: ``*``, ``-``, ``E``.

    Each layer type is a slice of megatron's own ``get_gpt_layer_local_spec``: ``*`` its
    input norm + self-attention, ``-`` its pre-MLP norm + dense MLP (``MLPLayer``), ``E`` its
    pre-MLP norm + MoE block (``MoETransformerLayer`` where the release has it).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer import transformer_layer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    stack_cls = _local_final_norm_stack()
    _, submodules_cls = _stack_classes()
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    fields = {
        "attention_layer": ModuleSpec(
            module=transformer_layer.TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=dense.input_layernorm,
                self_attention=dense.self_attention,
                self_attn_bda=dense.self_attn_bda,
            ),
        ),
        "mlp_layer": ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=dense.pre_mlp_layernorm,
                mlp=dense.mlp,
                mlp_bda=dense.mlp_bda,
            ),
        ),
    }
    if num_experts:
        moe = get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
        ).submodules
        fields["moe_layer"] = ModuleSpec(
            module=getattr(
                transformer_layer, "MoETransformerLayer", transformer_layer.TransformerLayer
            ),
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
            ),
        )
    known = {f.name for f in dataclasses.fields(submodules_cls)}
    return ModuleSpec(
        module=stack_cls,
        submodules=submodules_cls(**{k: v for k, v in fields.items() if k in known}),
    )


def build_hybrid_model(
    config: Any,
    pattern: str,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
) -> torch.nn.Module:
    """This release's hybrid language model for ``pattern``, built from local modules.

    Raises a clear error for symbols the local spec cannot build (see
    :func:`locally_supported_symbols`), instead of megatron's silent identity layers.
    """
    symbols = hybrid_layer_symbols(pattern)
    unsupported = sorted(set(symbols) - locally_supported_symbols())
    if unsupported:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} uses {unsupported}, which nemo_moe_metrics' "
            "reference model builds only from attention (*), MLP (-) and MoE (E) layers: "
            "Mamba (M) needs the mamba-ssm CUDA kernels, Gated DeltaNet (G) the "
            "flash-linear-attention Triton kernels, and megatron-core builds them from "
            "Transformer Engine specs; build such a model with megatron's own hybrid_stack_spec"
        )
    if len(symbols) != config.num_layers:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has {len(symbols)} layers but the "
            f"TransformerConfig has num_layers={config.num_layers}; they must agree"
        )
    model_cls, spec_kw, pattern_kw = hybrid_model_class()
    return model_cls(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        **{spec_kw: local_hybrid_stack_spec(config.num_moe_experts), pattern_kw: pattern},
    )
