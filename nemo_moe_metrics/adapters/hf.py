"""Hugging Face transformers MoE models: which module to count, and where the router logits are.

The router contract (:class:`~nemo_moe_metrics.moe.router_spec.RouterSpec`) for every family
transformers ships: counts, routes and health (readers in ``adapters.hf_health``); what configs
and modules say about themselves is in ``flops.hf_fields`` (the FLOP walk of a built model
reads it too).

transformers 5 gives nearly all of its MoE families two shared interfaces, and this adapter reads
those instead of keeping one entry per model:

- **the experts call** ``experts(hidden_states, top_k_index, top_k_weights)``: classes wrapped by
  transformers' ``use_experts_implementation``, or with that forward signature. A forward hook
  on the experts module sees exactly the assignments the experts execute (after any bias, group
  limit or hash routing), so the counts come from there;
- **the router-logit recorder** ``PreTrainedModel._can_record_outputs["router_logits"]``: the
  router class and the output index of its logits, which is what ``output_router_logits``
  collects for transformers' own load-balancing loss. The per-layer aux losses come from there.

A few families route differently and get a small named adapter (:data:`_NAMED`): dbrx (its FFN
calls the experts interface but has no config on the experts module), llama4 (the router is a
Linear returning ``(scores, logits)`` and the experts see every token), jetmoe (its gating
returns expert-sorted indices; only the MLP mixture of experts is counted, not the mixture of
attention heads) and doge (product-key expert retrieval: the chosen expert ids are the input
of its ``down_embed`` lookup). Two families have zero-computation experts: a pick of one reaches
the experts remapped to a real id with weight 0 (longcat_flash's ``zero_expert_num`` experts,
zaya's skip class); there the counts keep the picks with a non-zero weight and the others are
reported as ``moe/zero_expert_fraction``.

Nothing here imports transformers: classes are recognised by their attributes and names.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.adapters import hf_health
from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily
from nemo_moe_metrics.flops.hf_fields import (
    config_num_experts,
    config_topk,
    experts_num,
    is_experts_module,
    routing_args,
)
from nemo_moe_metrics.flops.registry import get_flops_estimator
from nemo_moe_metrics.moe.router_spec import (
    RouterSpec,
    count_experts,
    in_decoder_layer,
    layer_id_from_name,
    rows_of,
)


def masked_counts(index: torch.Tensor, num_experts: int, valid: torch.Tensor | None) -> tuple:
    """``(routed, tokens, executed)`` of expert ids ``index`` ``[T, k]`` (or ``[..., k]``):
    routed counts and tokens of the real rows (``valid`` [T], None = every row), executed
    counts of every row (what the experts compute, padding included). Device ops only."""
    rows = index.reshape(-1, index.shape[-1])
    valid = rows_of(valid, rows.shape[0])
    executed = count_experts(rows, num_experts)
    if valid is None:
        return executed, rows.shape[0], executed
    keep = valid.reshape(-1, 1).expand(rows.shape)
    return count_experts(rows, num_experts, keep), valid.sum(), executed


def _experts_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    index, _ = routing_args(args, kwargs)
    return masked_counts(index.reshape(index.shape[0], -1), int(module.num_experts), valid)


def _experts_picks(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    index, _ = routing_args(args, kwargs)
    return index.reshape(index.shape[0], -1), rows_of(valid, index.shape[0])


def _zero_computation_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    # A pick of a zero-computation expert arrives remapped to a real id with weight exactly 0
    # (longcat_flash, zaya): the real experts' load is the picks with a non-zero weight.
    index, weights = routing_args(args, kwargs)
    real = weights != 0
    valid = rows_of(valid, index.shape[0])
    if valid is not None:
        real = real & valid.reshape(-1, 1)
    tokens = index.shape[0] if valid is None else valid.sum()
    skipped = (~real).sum() if valid is None else ((weights == 0) & valid.reshape(-1, 1)).sum()
    return count_experts(index, int(module.num_experts), real), tokens, None, skipped


def _experts_routes(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    # The chosen ids themselves: routing consistency compares ids with ids, no [T, E] map.
    index, _ = routing_args(args, kwargs)
    chosen = index.reshape(index.shape[0], -1)
    return chosen, chosen, rows_of(valid, chosen.shape[0]), False


def _experts_topk(module: nn.Module) -> int:
    topk = config_topk(getattr(module, "config", None))
    if topk is None:
        raise ValueError(
            f"{type(module).__name__}: cannot tell its experts per token (no num_experts_per_tok "
            "or similar field on module.config); pass topk=... to nemo_moe_metrics.register_router"
        )
    return topk


EXPERTS = RouterSpec(
    counts_fn=_experts_counts,
    picks_fn=_experts_picks,
    num_experts=experts_num,
    topk=_experts_topk,
    routes_fn=_experts_routes,
    health=hf_health.hf_experts_health,
    expert_bias=hf_health.hf_expert_bias,
    padding_from_model=True,
)
ZERO_COMPUTATION_EXPERTS = dataclasses.replace(
    EXPERTS, counts_fn=_zero_computation_counts, picks_fn=None, zero_computation=True
)


# -- named adapters ----------------------------------------------------------------------------
def _logits_topk_counts(logits_at: int) -> Callable:
    # llama4 (Llama4Router -> (scores, logits)) and jetmoe (gating -> (..., logits)): both pick
    # topk(logits, k) and route exactly those experts; recomputing the topk is a device op.
    def counts(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
        logits = output[logits_at]
        index = torch.topk(logits, int(module.top_k), dim=-1).indices
        return masked_counts(index, logits.shape[-1], valid)

    return counts


def _logits_topk_routes(logits_at: int) -> Callable:
    def routes(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
        logits = output[logits_at]
        chosen = torch.topk(logits, int(module.top_k), dim=-1).indices
        return chosen, chosen, rows_of(valid, chosen.shape[0]), False

    return routes


def _doge_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    # hooked: DogeCDMoE.down_embed, looked up with the chosen expert ids [..., tokens, top_k]
    return masked_counts(args[0], int(module.num_embeddings), valid)


def _doge_routes(module: nn.Module, args: tuple, kwargs: dict, output: Any, valid=None):
    chosen = args[0].reshape(-1, args[0].shape[-1])
    return chosen, chosen, rows_of(valid, chosen.shape[0]), False


def _text_experts(block: nn.Module) -> nn.Module:
    # Modality-isolated experts (ernie4_5_vl_moe): text tokens go to text_moe, image and video
    # tokens to vision_moe, two expert sets in one layer; a layer's table holds one set.
    warnings.warn(
        f"{type(block).__name__}: each MoE layer has text experts and vision experts; the expert "
        "loads, balance and router health are the text experts' (the vision experts, which only "
        "image and video tokens reach, are not counted)",
        stacklevel=2,
    )
    return block.text_moe.experts


_NAMED: dict[str, RouterSpec] = {
    "transformers.models.dbrx.modeling_dbrx.DbrxFFN": RouterSpec(
        counts_fn=_experts_counts,  # hooked: DbrxFFN.experts, the shared experts interface
        picks_fn=_experts_picks,
        num_experts=lambda m: int(m.experts.num_experts),
        topk=lambda m: int(m.top_k),
        routes_fn=_experts_routes,
        hooked=lambda m: m.experts,
        health=lambda m, parent: hf_health.hf_experts_health(m.experts, m),
        padding_from_model=True,
    ),
    "transformers.models.llama4.modeling_llama4.Llama4TextMoe": RouterSpec(
        counts_fn=_logits_topk_counts(1),
        num_experts=lambda m: int(m.num_experts),
        topk=lambda m: int(m.top_k),
        routes_fn=_logits_topk_routes(1),
        hooked=lambda m: m.router,
        health=lambda m, parent: hf_health.hf_health(m.router, m),
        padding_from_model=True,
    ),
    "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoE": RouterSpec(
        counts_fn=_logits_topk_counts(4),
        num_experts=lambda m: int(m.router.num_experts),
        topk=lambda m: int(m.router.top_k),
        routes_fn=_logits_topk_routes(4),
        hooked=lambda m: m.router,
        health=lambda m, parent: hf_health.hf_health(m.router, m),
        padding_from_model=True,
    ),
    "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeBlock": (
        RouterSpec(
            counts_fn=_experts_counts,
            picks_fn=_experts_picks,
            num_experts=lambda m: experts_num(m.text_moe.experts),
            topk=lambda m: int(m.text_moe.top_k),
            routes_fn=_experts_routes,
            hooked=_text_experts,
            health=lambda m, parent: hf_health.hf_experts_health(m.text_moe.experts, m.text_moe),
            token_subset=True,
            padding_from_model=True,
        )
    ),
    "transformers.models.doge.modeling_doge.DogeCDMoE": RouterSpec(
        counts_fn=_doge_counts,
        num_experts=lambda m: int(m.num_experts),
        topk=lambda m: int(m.top_k),
        routes_fn=_doge_routes,
        hooked=lambda m: m.down_embed,
        health=hf_health.doge_health,
        padding_from_model=True,
    ),
}
#: Families whose experts include zero-computation experts (by modeling module).
_ZERO_COMPUTATION_MODULES = ("longcat_flash", "zaya")
#: Router logits the recorder does not declare (``_can_record_outputs`` lacks them), by class.
_NAMED_LOGITS: dict[str, int] = {"transformers.models.llama4.modeling_llama4.Llama4Router": 1}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def spec_for(module: nn.Module) -> RouterSpec | None:
    """The spec that counts ``module`` when it is a transformers MoE module, else None."""
    # The MRO: FSDP2's fully_shard (and user subclasses) put another class in front.
    for cls in type(module).__mro__:
        named = _NAMED.get(_qualname(cls))
        if named is not None:
            return named
    if not is_experts_module(module):
        return None
    own = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))
    family = own.__module__.split(".")[2] if own.__module__.startswith("transformers.") else ""
    return ZERO_COMPUTATION_EXPERTS if family in _ZERO_COMPUTATION_MODULES else EXPERTS


# -- router logits -----------------------------------------------------------------------------
def _recorded_routers(chunks: list[nn.Module]) -> list[tuple[type, int, str | None]]:
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            recorders = getattr(type(module), "_can_record_outputs", None)
            recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
            target = getattr(recorder, "target_class", None)
            if target is not None:
                entry = (target, int(getattr(recorder, "index", 0) or 0), recorder.layer_name)
                if entry not in found:
                    found.append(entry)
    return found


def router_logit_sources(
    chunks: list[nn.Module], blocks: dict[int, str]
) -> list[tuple[int, nn.Module, int, int | None]]:
    """``(layer id, router module, index of its logits in the output, index of its expert ids
    where they are the top-k of the softmax of those logits, else None)`` per counted MoE layer.

    ``blocks``: the module-name prefix of each counted layer's MoE block; a router counts for a
    layer only inside that block (jetmoe's attention-head router is left out that way). The
    routers are the class the model records as ``router_logits`` (what transformers' own
    load-balancing loss reads), plus the named ones it does not declare (llama4).
    """
    recorded = _recorded_routers(chunks)
    out: dict[int, tuple[int, nn.Module, int, int | None]] = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            index = _NAMED_LOGITS.get(_qualname(type(module)))
            if index is None:
                index = next(
                    (
                        i
                        for cls, i, layer_name in recorded
                        if isinstance(module, cls)
                        and (layer_name is None or name.endswith(layer_name))
                    ),
                    None,
                )
            if index is None or not in_decoder_layer(name):
                continue
            layer = layer_id_from_name(name)
            block = blocks.get(layer)
            if block is not None and (name == block or name.startswith(block + ".")):
                ids_at = hf_health.softmax_topk_ids_at(module, index)
                out.setdefault(layer, (layer, module, index, ids_at))
    return [out[k] for k in sorted(out)]


def aux_loss_kind(chunks: list[nn.Module]) -> str | None:
    """Which load-balancing loss the model's own training computes: ``"switch"`` (transformers'
    ``load_balancing_loss_func``), ``"doge"`` (its product-key variant) or None (none)."""
    for chunk in chunks:
        for module in chunk.modules():
            recorders = getattr(type(module), "_can_record_outputs", None)
            if not (isinstance(recorders, dict) and "router_logits" in recorders):
                continue
            # The model's own class (FSDP2's fully_shard swaps in a subclass from torch).
            own = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))
            modeling = sys.modules.get(own.__module__)
            if getattr(modeling, "load_balancing_loss_func", None) is None:
                return None
            return "doge" if own.__module__.endswith(".modeling_doge") else "switch"
    return None


# -- configs and the family ---------------------------------------------------------------------
def _pretrained_config_type() -> type | None:
    # A PretrainedConfig means transformers is imported already: nothing is imported here.
    transformers = sys.modules.get("transformers")
    return transformers.PretrainedConfig if transformers is not None else None


def _from_dict(config: Any) -> Any:
    """A ``config.json`` dict (with ``model_type``) as its transformers config class."""
    if isinstance(config, Mapping) and "model_type" in config:
        from transformers import AutoConfig

        data = {k: v for k, v in config.items() if k != "model_type"}
        return AutoConfig.for_model(config["model_type"], **data)
    return config


def owns_config(config: Any) -> bool:
    """A transformers ``PretrainedConfig``, or its ``config.json`` as a dict with model_type."""
    if isinstance(config, Mapping):
        return "model_type" in config
    pretrained = _pretrained_config_type()
    return pretrained is not None and isinstance(config, pretrained)


def hf_facts(config: Any) -> ModelFacts:
    """Experts, layers, top-k and model type of a transformers config (or config.json dict)."""
    config = _from_dict(config)
    text = config.get_text_config()  # composite configs (qwen3_5_moe) keep it inside
    experts = config_num_experts(text)
    # Whether the model computes a load-balancing loss is read from the model at attach.
    aux = "hf" if experts else None
    layers = int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layers", 0) or 0)
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    return ModelFacts(experts, layers, 1, aux, "hf", model_type, topk=config_topk(text))


def _own_hf_config(chunks: list[Any]) -> Any:
    """The transformers config the model itself carries (``model.config``, also under DDP's
    ``.module``), or None."""
    pretrained = _pretrained_config_type()
    if pretrained is None or not chunks:
        return None
    for module in (chunks[0], getattr(chunks[0], "module", None)):
        own = getattr(module, "config", None)
        if isinstance(own, pretrained):
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
    given = _from_dict(config)
    if not isinstance(given, _pretrained_config_type()):
        return config  # another kind of config: the families say what they accept
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
            stacklevel=4,
        )
        return own
    return config


def _aux_loss_sources(chunks: list[nn.Module], blocks: dict[int, str]) -> tuple[str | None, list]:
    kind = aux_loss_kind(chunks)
    return kind, (router_logit_sources(chunks, blocks) if kind else [])


FAMILY = ModelFamily(
    name="hf",
    owns_config=owns_config,
    facts=hf_facts,
    router_spec=spec_for,
    flops=lambda config, vocab_size, model: get_flops_estimator(
        config, vocab_size=vocab_size, model=model
    ),
    as_built=checked_hf_config,
    aux_loss_sources=_aux_loss_sources,
    bias_from_modules=True,
)
