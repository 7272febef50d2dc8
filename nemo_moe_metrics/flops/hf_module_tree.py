"""What a transformers model's modules are, read by name and shape: its decoder layers, routed
experts, routers, dense MLPs and encoder towers, and the per-token multiply-adds of a module's
own weight matrices (:func:`weight_macs`).

The rules that tell a module's kind live here once; :mod:`nemo_moe_metrics.flops.hf_mixers`
(token mixers) and :mod:`nemo_moe_metrics.flops.hf_modules` (the whole model) apply them.
A parameter with two or more dimensions that no rule claims raises
:class:`~nemo_moe_metrics.flops.errors.UnsupportedModelError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nemo_moe_metrics.flops.errors import UnsupportedModelError
from nemo_moe_metrics.flops.hf_fields import EXPERT_COUNT_FIELDS, TOPK_FIELDS, is_experts_module

# A module's own attribute first (routers and MoE blocks keep `top_k`), then the config fields.
TOP_K_FIELDS = ("top_k", *TOPK_FIELDS)
NUM_EXPERTS_FIELDS = EXPERT_COUNT_FIELDS
ROUTER_CLASS_WORDS = ("Router", "Gating", "TopkGate")
ROUTER_NAMES = ("gate", "router", "router_gate")
# Parameters with two or more dimensions that are not matmul weights (added, gathered, or
# element-wise), by parameter name.
NOT_MATMUL = (
    "position_bias",
    "e_score_correction_bias",
    "A_log",
    "sinks",
    "index_kpool_compress_ape",  # GLM-5-Next: added to the pool-gate logits
)
# Parameters used as matmul weights (F.linear) under another name than ``weight``.
MATMUL = ("index_kpool_compress_gate",)  # GLM-5-Next: per-token pool-gate scores


def is_routed_experts(module: Any) -> bool:
    """transformers' experts interface (``flops.hf_fields``), or an ``...Experts`` module holding
    expert weights (dbrx, llama4)."""
    if is_experts_module(module):
        return True
    name = type(module).__name__
    return name.endswith("Experts") and not name.endswith("SharedExperts")


def top_k_of(*sources: Any) -> int | None:
    """The experts per token: the first positive top-k field of ``sources`` (or None)."""
    for source in sources:
        for name in TOP_K_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def num_experts_of(experts: Any, *sources: Any) -> int:
    """The number of experts: a 3-D weight's first dimension, else an expert-count field."""
    three_d = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
    if three_d:
        return int(three_d[0].shape[0])
    for source in (experts, *sources):
        for name in NUM_EXPERTS_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise UnsupportedModelError(f"{type(experts).__name__}: cannot tell its number of experts")


def weight_macs(
    module: Any, model_type: str, top_k: int | None = None, heads: int | None = None
) -> int:
    """Multiply-adds per token of every weight matmul in ``module``'s subtree."""
    return sum(own_macs(m, name, model_type, top_k, heads) for name, m in named_modules(module))


def own_macs(
    module: Any, name: str, model_type: str, top_k: int | None, heads: int | None = None
) -> int:
    """Multiply-adds per token of ``module``'s own parameters (its children excluded)."""
    nn = torch.nn
    cls = type(module).__name__
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, nn.Embedding):
        return 0  # a lookup
    if isinstance(module, (nn.Linear, nn.Conv1d)):
        return int(module.weight.numel())
    if "Norm" in cls or cls.endswith(("Clip", "LogScale")):
        return 0  # element-wise scales, whatever their shape
    if cls.endswith("AttentionResidual"):
        return 0  # attention over the block states: _depth_attention
    if cls.endswith(("RelativeLogits", "RelativePositionBias")):
        # Inkling: per token and head, relative states (d_rel) times a bank of bias
        # profiles (d_rel x rel_extent): one small matmul per head, whatever the length.
        count = first_int(module, "num_heads") or heads
        if "proj" not in params or count is None:
            raise UnsupportedModelError(f"{model_type}: {cls} without proj or heads")
        return int(params["proj"].numel()) * count
    if cls.endswith("DynamicShortConvolution"):
        # Inkling 2: a depthwise conv whose taps are static weights plus per-token ones.
        return int(params["static_weight"].numel())
    if cls.endswith(("HyperConnection", "HyperHead")) and ("fn" in params or "hc_fn" in params):
        return _hyper_connection_macs(module, params)
    if is_routed_experts(module) and not name.rsplit(".", 1)[-1].startswith("shared"):
        k = top_k_of(module) or top_k
        if k is None:
            raise UnsupportedModelError(f"{cls}: cannot tell how many experts a token uses")
        return int(round(k * expert_weights(module) / num_experts_of(module)))
    total = 0
    for pname, p in params.items():
        if p.dim() < 2 or pname in NOT_MATMUL:
            continue
        if any(word in cls for word in ROUTER_CLASS_WORDS) or pname in ("weight", *MATMUL):
            total += p.numel()  # a router's (or a linear-like module's) weight matrix
        elif p.dim() == 3 and cls.endswith("SharedExperts"):
            total += p.numel()  # shared experts stacked in one tensor: all of them run
        else:
            raise UnsupportedModelError(
                f"{model_type}: no FLOP rule for {cls}.{pname} {tuple(p.shape)}; "
                "register a formula with register_flops_estimator"
            )
    return total


def _hyper_connection_macs(module: Any, params: dict[str, Any]) -> int:
    # Hyper-connections (DeepSeek-V4, HY-V4): one projection of the hc_mult flattened
    # streams to the mixing weights; DeepSeek-V4 also mixes the streams with an
    # hc_mult x hc_mult matrix per token (its Sinkhorn "comb" weights), a matmul.
    fn = params.get("fn", params.get("hc_fn"))
    macs = int(fn.numel())
    if hasattr(module, "hc_sinkhorn_iters"):
        # [hc_mult x hc_mult] @ [hc_mult x hidden]; fn's input is hc_mult x hidden wide.
        macs += int(module.hc_mult) * int(fn.shape[1])
    return macs


def expert_weights(experts: Any) -> int:
    """The matmul weights of all experts of an experts module (biases and norms left out)."""
    return sum(
        p.numel()
        for module in experts.modules()
        if "Norm" not in type(module).__name__
        for n, p in module.named_parameters(recurse=False)
        if p.dim() >= 2 and "bias" not in n
    )


def experts_parents(module: Any) -> list[Any]:
    """The modules of ``module``'s subtree that hold routed experts as children."""
    return [m for m in module.modules() if any(is_routed_experts(c) for c in m.children())]


def first_int(module: Any, *names: str) -> int | None:
    """The first of ``names`` that ``module`` holds as a positive int (bools are not)."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def is_router(name: str, module: Any) -> bool:
    """A router by its attribute name or class name."""
    cls = type(module).__name__
    return name in ROUTER_NAMES or any(w in cls for w in ROUTER_CLASS_WORDS)


def holds_experts(module: Any) -> bool:
    """An MoE block: a module whose children include routed experts."""
    return any(is_routed_experts(c) for c in module.children())


def in_moe(name: str, module: Any) -> bool:
    """A decoder layer's own experts or router (gemma4)."""
    return is_routed_experts(module) or is_router(name, module)


def is_dense_mlp(name: str, module: Any) -> bool:
    """A dense feed-forward block by its attribute name or class name."""
    cls = type(module).__name__
    return name in ("mlp", "feed_forward", "ffn") or cls.endswith(("MLP", "Mlp", "FeedForward"))


def is_tower(name: str) -> bool:
    """A vision or audio encoder (not costed) by its module path."""
    return any(word in name for word in ("vision", "audio", "visual", "multi_modal"))


def named_modules(module: Any) -> Iterator[tuple[str, Any]]:
    """Every module of the subtree, a module shared under two names counted under each."""
    return module.named_modules(remove_duplicate=False)


def decoder_layers(model: Any) -> tuple[Any, list[Any]]:
    """The text model and its decoder layers: the first ModuleList of the classes transformers
    keeps unsplit (else the longest one named ``layers``), outside any vision or audio tower."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    best: tuple[Any, list[Any]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or is_tower(name) or not len(module):
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if all(type(m).__name__ in no_split for m in module):
            return owner, list(module)
        if "layers" in name.rsplit(".", 1)[-1] and (best is None or len(module) > len(best[1])):
            best = owner, list(module)
    if best is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers found")
    return best
