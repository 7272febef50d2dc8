"""What a model's config says the metrics need: experts, layers, expert parallelism, aux loss.

One function, :func:`model_facts`, reads a megatron-core ``TransformerConfig``, a transformers
``PretrainedConfig`` (or its ``config.json`` as a dict) or a torchtitan model config; its type
picks the family. FLOPs need no facts: ``nemo_moe_metrics.flops`` takes each config type itself.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nemo_moe_metrics.adapters.hf_fields import config_num_experts, config_topk
from nemo_moe_metrics.adapters.torchtitan import is_torchtitan_config, torchtitan_model_facts


@dataclass(frozen=True)
class ModelFacts:
    """What the worker needs to know about a model, read from its config."""

    num_experts: int  #: routed experts per MoE layer; 0 for a dense model
    num_layers: int  #: decoder layers (global layer ids index into them)
    ep_size: int  #: expert-parallel ranks (1 for Hugging Face models)
    aux_loss: Literal["megatron", "hf"] | None  #: where aux losses come from; None: none
    #: which kind of config described the model
    source: Literal["megatron", "hf", "torchtitan"] = "megatron"
    model_type: str | None = None  #: the Hugging Face model_type (None for megatron)
    expert_bias: bool = False  #: routers keep an aux-loss-free expert bias (moe/expert_bias.py)
    topk: int | None = None  #: experts each token is routed to (None: the config names none)


def model_facts(config: Any) -> ModelFacts:
    """The adapter: a transformers ``PretrainedConfig`` or a megatron ``TransformerConfig``.

    FLOPs need no adapter: ``nemo_moe_metrics.flops`` takes either config type.
    """
    if is_torchtitan_config(config):  # torchtitan's model config (e.g. DeepSeekV3Model.Config)
        experts, layers, bias, topk = torchtitan_model_facts(config)
        return ModelFacts(experts, layers, 1, None, "torchtitan", expert_bias=bias, topk=topk)
    if isinstance(config, Mapping) and "model_type" in config:  # a config.json dict
        from transformers import AutoConfig

        data = {k: v for k, v in config.items() if k != "model_type"}
        config = AutoConfig.for_model(config["model_type"], **data)
    transformers = sys.modules.get("transformers")  # a PretrainedConfig means it is imported
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        text = config.get_text_config()  # composite configs (qwen3_5_moe) keep it inside
        experts = config_num_experts(text)
        # Whether the model computes a load-balancing loss is read from the model at attach.
        aux = "hf" if experts else None
        layers = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layers", 0) or 0)
        model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
        return ModelFacts(experts, layers, 1, aux, "hf", model_type, topk=config_topk(text))
    if not hasattr(config, "num_layers"):
        raise TypeError(
            f"PolicyMetrics.attach(model, config): config is a {type(config).__name__}; pass the "
            "model's megatron-core TransformerConfig or its transformers PretrainedConfig "
            "(model.config, or its config.json as a dict with model_type), or a torchtitan "
            "model config (e.g. DeepSeekV3Model.Config)"
        )
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    bias = bool(experts and getattr(config, "moe_router_enable_expert_bias", False))
    aux = "megatron" if experts else None
    topk = int(getattr(config, "moe_router_topk", 0) or 0) or None
    return ModelFacts(experts, int(config.num_layers), ep, aux, expert_bias=bias, topk=topk)


def _own_hf_config(chunks: list[Any]) -> Any:
    """The transformers config the model itself carries (``model.config``, also under DDP's
    ``.module``), or None."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not chunks:
        return None
    for module in (chunks[0], getattr(chunks[0], "module", None)):
        own = getattr(module, "config", None)
        if isinstance(own, transformers.PretrainedConfig):
            return own
    return None


def checked_hf_config(chunks: list[Any], config: Any) -> Any:
    """The config ``attach`` reads for a transformers model.

    ``config`` itself when it is the model's own or describes the same model type. Another
    family's config with the same experts and experts per token is set aside for the model's own
    config, with a warning; one that contradicts the model's (expert count, top-k) is an error.
    """
    own = _own_hf_config(chunks)
    if own is None or config is own:
        return config
    given = config
    if isinstance(config, Mapping) and "model_type" in config:  # a config.json dict
        from transformers import AutoConfig

        given = AutoConfig.for_model(
            config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}
        )
    if not isinstance(given, sys.modules["transformers"].PretrainedConfig):
        return config  # another kind of config: model_facts says what it accepts
    theirs, ours = given.get_text_config(), own.get_text_config()
    said = {
        "experts": (config_num_experts(theirs), config_num_experts(ours)),
        "experts per token": (config_topk(theirs), config_topk(ours)),
    }
    wrong = [f"{what} {a} (the model: {b})" for what, (a, b) in said.items() if a != b]
    if wrong:
        raise ValueError(
            f"PolicyMetrics.attach: the config ({theirs.model_type}) contradicts the model "
            f"({ours.model_type}): {', '.join(wrong)}; pass the model's own config: "
            "attach(model, model.config)"
        )
    if theirs.model_type != ours.model_type:
        warnings.warn(
            f"PolicyMetrics.attach: the config is a {theirs.model_type} config but the model is "
            f"{ours.model_type}; its experts and experts per token agree, and the model's own "
            "config (model.config) is used instead (layers, FLOPs): pass that one",
            RuntimeWarning,
            stacklevel=3,
        )
        return own
    return config
