"""FLOP shapes read from a built transformers model's modules: every family, no formula needed.

:func:`model_shape` walks the decoder layers of a causal LM once and returns the same
:class:`~nemo_moe_metrics.flops.core.ModelShape` the registered formulas build, so the estimate
uses the same arithmetic and conventions (``flops/core.py``). What each kind of module adds:

This module assembles the model: the decoder layers in execution order, each a list of
:class:`~nemo_moe_metrics.flops.core.Layer` (mixers paired with feed-forward blocks), MoE
blocks, and the entry points (a built model, a config built on the meta device). The rules for
each kind of module live in :mod:`~nemo_moe_metrics.flops.hf_module_tree` (weights, experts,
routers) and :mod:`~nemo_moe_metrics.flops.hf_mixers` (token mixers).

- every ``nn.Linear`` (and subclass) and every ``nn.Conv1d``: its weight's element count in
  multiply-adds per token (a depthwise conv: channels x kernel);
- routed experts (the module transformers calls as ``experts(hidden, top_k_index,
  top_k_weights)``, or an ``...Experts`` module): their matmul weights / ``num_experts`` x
  ``top_k``; the router (its weight, or its whole MLP); everything else in the MoE block is a
  shared expert (with its gate);
- softmax attention (a module with ``scaling``): its projections, and ``heads x (qk_head_dim +
  v_head_dim)`` per attended pair with the module's sliding window; a DSA indexer sets the
  window to its ``index_topk`` and adds its own cost (component ``indexer``);
- Gated DeltaNet, Kimi Delta Attention, MiniMax lightning attention, Mamba-1, Mamba-2 and LFM2's
  short convolutions: projections, conv and the recurrent-equivalent core of ``core.py``;
- hyper-connections, per-layer input projections and other per-token matmuls outside the
  mixer and feed-forward block: ``other_projections``.

A decoder-layer parameter with two or more dimensions that no rule claims raises
:class:`UnsupportedModelError` naming it: an unknown module is never silently costed as zero.
The per-family exceptions (llama4's every-expert implementation, doge's product-key experts,
jetmoe's attention experts, dbrx's expert GLU, DeepSeek-V4's compressed attention, ...) are
named where they are handled (here, in ``hf_mixers`` and ``hf_module_tree``) and in
docs/en/flops.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_moe_metrics.flops.core import DenseMLP, FlopsEstimator, Layer, ModelShape, MoEMLP
from nemo_moe_metrics.flops.errors import NotInTransformersError, UnsupportedModelError
from nemo_moe_metrics.flops.hf_mixers import MixerReader
from nemo_moe_metrics.flops.hf_module_tree import (
    decoder_layers,
    expert_weights,
    holds_experts,
    in_moe,
    is_dense_mlp,
    is_routed_experts,
    is_router,
    is_tower,
    named_modules,
    num_experts_of,
    own_macs,
    top_k_of,
    weight_macs,
)


@dataclass
class _Parts:
    """What one decoder layer holds, in module order."""

    mixers: list[Any] = field(default_factory=list)
    ffns: list[DenseMLP | MoEMLP] = field(default_factory=list)
    other: int = 0


class _Walker:
    """Reads one model: the text config, the decoder layers, the per-kind rules."""

    def __init__(self, model: Any) -> None:
        self.model = model
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no transformers config; derive FLOPs from a "
                "transformers causal LM (model.config) or register a formula"
            )
        self.config = config.get_text_config()
        self.model_type = str(getattr(self.config, "model_type", type(model).__name__))
        self.mixers = MixerReader(self.config, self.model_type)

    def weight_macs(self, module: Any, top_k: int | None = None) -> int:
        """Multiply-adds per token of every weight matmul in ``module``'s subtree."""
        return weight_macs(module, self.model_type, top_k)

    def _own_macs(self, module: Any, name: str) -> int:
        return own_macs(module, name, self.model_type, None)

    # ---- the model -----------------------------------------------------------------------
    def shape(self) -> ModelShape:
        text_model, layers_list = decoder_layers(self.model)
        claimed = {id(m) for layer in layers_list for m in layer.modules()}
        head = self.model.get_output_embeddings()
        if head is None:
            raise UnsupportedModelError(f"{self.model_type}: the model has no output embeddings")
        claimed |= {id(m) for m in head.modules()}
        vocab, hidden = (int(d) for d in head.weight.shape)
        # A vision-language model (its text config apart from its config): only the language
        # model and the output head run on text; its encoders, projectors and resamplers
        # (ernie4_5_vl_moe's, whatever their names) are not costed.
        multimodal = self.config is not self.model.config
        text_modules = {id(m) for m in text_model.modules()}
        other = 0
        for name, module in named_modules(self.model):
            if id(module) in claimed or is_tower(name):
                continue
            if multimodal and id(module) not in text_modules:
                continue
            other += self._own_macs(module, name)
        per_layer = [self._layer(layer) for layer in layers_list]
        order = _execution_order(self.config, len(layers_list))
        depth, final_depth = _depth_attention(text_model, layers_list, order, hidden)
        layers: list[Layer] = []
        for step, (index, loop_pass) in enumerate(order):
            first, *rest = per_layer[index]
            extra = depth[step]
            if loop_pass:  # Inkling 2 loops: passes after the first gate in the messages
                extra += sum(
                    self.weight_macs(m)
                    for m in layers_list[index].children()
                    if type(m).__name__.endswith("MessageGate")
                )
            layers.append(dataclasses.replace(first, other_params=first.other_params + extra))
            layers.extend(rest)
        return ModelShape(
            model_type=self.model_type,
            hidden_size=hidden,
            layers=tuple(layers),
            vocab_size=vocab,
            tied_embeddings=bool(getattr(self.config, "tie_word_embeddings", False)),
            other_params=other + final_depth,
        )

    def _layer(self, layer: Any) -> list[Layer]:
        """One decoder layer as Layers: its mixers paired in order with its feed-forward blocks
        (longcat_flash has two of each and an MoE block; gemma4 a dense MLP beside its MoE)."""
        parts = _Parts()
        children = dict(layer.named_children())
        if holds_experts(layer):
            # gemma4: the experts and their router are the decoder layer's own children.
            block = self._moe(layer, shared_members=False)
            parts.ffns.append(block)
            children = {n: c for n, c in children.items() if not in_moe(n, c)}
        self._check_own(layer)
        shared = 0
        for name, child in children.items():
            if type(child).__name__.endswith("MessageGate"):
                continue  # runs in Inkling 2 loop passes after the first only: see shape()
            if name.startswith("shared"):
                shared += self.weight_macs(child)  # granitemoe*: beside the MoE block
                continue
            self._visit(child, name, parts)
        if shared:
            moe = [i for i, ffn in enumerate(parts.ffns) if isinstance(ffn, MoEMLP)]
            if moe:
                ffn = parts.ffns[moe[0]]
                parts.ffns[moe[0]] = dataclasses.replace(
                    ffn, shared_params=ffn.shared_params + shared
                )
            else:
                parts.ffns.append(DenseMLP(shared))
        out: list[Layer] = []
        for i in range(max(len(parts.mixers), len(parts.ffns), 1)):
            mixer = parts.mixers[i] if i < len(parts.mixers) else None
            ffn = parts.ffns[i] if i < len(parts.ffns) else None
            other = parts.other if i == 0 else 0
            if mixer is not None or ffn is not None or other:
                out.append(Layer(mixer, ffn, other))
        return out

    def _visit(self, module: Any, name: str, parts: _Parts) -> None:
        """Claim ``module``'s subtree for a mixer or a feed-forward block, or count its own
        weights as other projections and look at its children."""
        if holds_experts(module) or type(module).__name__.endswith("CDMoE"):
            parts.ffns.append(self._moe(module))
            return
        modality_moe = self._modality_moe(module)
        if modality_moe is not None:
            parts.ffns.append(modality_moe)
            return
        mixer = self.mixers.mixer(module)
        if mixer is not None:
            parts.mixers.extend(mixer if isinstance(mixer, list) else [mixer])
            return
        if is_dense_mlp(name, module):
            parts.ffns.append(DenseMLP(self.weight_macs(module)))
            return
        parts.other += self._own_macs(module, name)
        for child_name, child in module.named_children():
            self._visit(child, child_name, parts)

    def _check_own(self, module: Any) -> None:
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                raise UnsupportedModelError(
                    f"{self.model_type}: no FLOP rule for {type(module).__name__}.{pname} "
                    f"{tuple(p.shape)}"
                )

    # ---- MoE -----------------------------------------------------------------------------
    def _moe(self, block: Any, shared_members: bool = True) -> MoEMLP:
        """A MoE block: its routed experts, its router(s), and (``shared_members``) everything
        else it holds as shared experts."""
        cls = type(block).__name__
        if cls.endswith("CDMoE"):
            return self._doge_cdmoe(block)
        children = dict(block.named_children())
        experts = [c for c in children.values() if is_routed_experts(c)]
        routers = [c for n, c in children.items() if is_router(n, c) and c not in experts]
        top_k = top_k_of(*routers, block, *experts, self.config)
        if top_k is None:
            raise UnsupportedModelError(f"{self.model_type}: {cls} has no top_k")
        num_experts = num_experts_of(experts[0], *routers, block, self.config)
        shared = 0
        if shared_members:
            shared = self._own_macs(block, "") + sum(
                self.weight_macs(c) for c in children.values() if c not in experts + routers
            )
        return MoEMLP(
            router_params=sum(self.weight_macs(r) for r in routers),
            expert_params=sum(expert_weights(e) for e in experts) // num_experts,
            num_experts=num_experts,
            top_k=top_k,
            shared_params=shared,
        )

    def _modality_moe(self, block: Any) -> MoEMLP | None:
        """Modality-isolated experts (ernie4_5_vl_moe: ``text_moe`` and ``vision_moe`` in one
        layer), or None for another module. A text token runs the text MoE block and the
        shared experts; the vision (or audio) experts run on those tokens only and are left out,
        as the encoders are: the estimate costs every token as a text token."""
        children = dict(block.named_children())
        moe = {name: child for name, child in children.items() if holds_experts(child)}
        text = [child for name, child in moe.items() if not is_tower(name)]
        if len(moe) < 2 or len(text) != 1:
            return None
        ffn = self._moe(text[0])
        shared = self._own_macs(block, "") + sum(
            self.weight_macs(child) for name, child in children.items() if name not in moe
        )
        return dataclasses.replace(ffn, shared_params=ffn.shared_params + shared)

    def _doge_cdmoe(self, block: Any) -> MoEMLP:
        # Doge's product-key experts: each picked expert is one row of down_embed and one of
        # up_embed (2 x hidden multiply-adds); gate/up/down_proj are a shared MLP.
        shared = sum(
            self.weight_macs(getattr(block, n)) for n in ("gate_proj", "up_proj", "down_proj")
        )
        return MoEMLP(
            router_params=self.weight_macs(block.router_gate),
            expert_params=int(block.down_embed.weight.shape[1] + block.up_embed.weight.shape[1]),
            num_experts=int(block.num_experts),
            top_k=int(block.top_k),
            shared_params=shared,
        )


def _execution_order(config: Any, num_layers: int) -> list[tuple[int, int]]:
    """(decoder layer, loop pass) in the order the model runs them.

    Inkling 2 loops run layers ``loop_layer_index_start`` to ``loop_layer_index_end - 1``
    ``loop_num_passes`` times; every other model runs each layer once.
    """
    start = getattr(config, "loop_layer_index_start", None)
    end = getattr(config, "loop_layer_index_end", None)
    passes = int(getattr(config, "loop_num_passes", 1) or 1)
    if start is None or end is None or passes <= 1 or not 0 <= start < end <= num_layers:
        return [(i, 0) for i in range(num_layers)]
    order = [(i, 0) for i in range(start)]
    for loop_pass in range(passes):
        order += [(i, loop_pass) for i in range(start, end)]
    return order + [(i, 0) for i in range(end, num_layers)]


def _depth_attention(
    text_model: Any, layers: list[Any], order: list[tuple[int, int]], hidden: int
) -> tuple[list[int], int]:
    """Inkling 2's attention residuals: per-token multiply-adds of each executed layer's
    attention over the stack of block states (learned queries, no projections), and of the
    model's final one.

    A query over ``n`` stacked states costs ``2 * hidden * n`` (scores and weighted sum). The
    stack grows by one at every block boundary (``n_layers_per_attn_res_block``); a loop pass
    after the first restarts from the pre-loop stack and first reads messages (4 queries) from
    the states the previous pass added. Zero for every other family.
    """
    macs = [0] * len(order)
    if not any(hasattr(layers[i], "mlp_input") for i, _ in order):
        return macs, 0

    def cost(residual: Any, keys: int) -> int:
        query = residual.query
        queries = 1 if query.dim() == 1 else int(query.shape[-2])
        return 2 * queries * hidden * keys

    loop_start = next((i for i, loop_pass in order if loop_pass), None)
    states, pre_loop, pass_end = 0, 0, 0
    message = getattr(text_model, "message_input", None)
    for step, (index, loop_pass) in enumerate(order):
        layer = layers[index]
        if index == loop_start and loop_pass == 0:
            pre_loop = states
        if loop_pass and order[step - 1][1] != loop_pass:  # a new pass starts over
            pass_end, states = states, pre_loop
        if loop_pass and message is not None:
            # The states the previous pass added after its first, plus the partial one.
            macs[step] += cost(message, pass_end - pre_loop)
        if getattr(layer, "attention_input", None) is not None:
            macs[step] += cost(layer.attention_input, states + 1)
        boundary = bool(getattr(layer, "is_block_boundary", False))
        macs[step] += cost(layer.mlp_input, states + boundary + 1)
        states += boundary
    final = getattr(text_model, "final_input", None)
    return macs, cost(final, states + 1) if final is not None else 0


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a built transformers causal LM, read from its modules."""
    return _Walker(model).shape()


def estimator_from_model(model: Any, *, vocab_size: int | None = None) -> FlopsEstimator:
    """A :class:`FlopsEstimator` for a built transformers causal LM (any family).

    ``vocab_size`` replaces the lm_head width read from the model (0 leaves it out).
    """
    shape = model_shape(model)
    if vocab_size is not None:
        if vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
        shape = dataclasses.replace(shape, vocab_size=int(vocab_size))
    return FlopsEstimator(shape)


def estimator_from_config(config: Any, *, vocab_size: int | None = None) -> FlopsEstimator:
    """A :class:`FlopsEstimator` for a transformers config: its model built on the meta device.

    No memory is allocated and no weights are initialised; a 671B-parameter skeleton takes
    well under a second.
    """
    return estimator_from_model(meta_model(config), vocab_size=vocab_size)


def is_readable(model: Any) -> bool:
    """Whether FLOPs can be read from ``model``: a transformers model (it has a config with a
    text config) whose linear layers hold their full weight shapes here.

    False under wrappers that shard or offload parameters in place (FSDP1 flat parameters,
    DeepSpeed ZeRO-3), whose modules then show empty weights; DTensor parameters (FSDP2,
    tensor parallel) report their global shape and are readable.
    """
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config") or not hasattr(model, "modules"):
        return False
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = getattr(module, "weight", None)
            if weight is None or tuple(weight.shape) != (module.out_features, module.in_features):
                return False
    return True


def transformers_config(config: Any) -> Any:
    """``config`` as a transformers ``PretrainedConfig`` (a config.json dict is loaded with
    ``AutoConfig.for_model``); NotInTransformersError when transformers does not know its type."""
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return config
    from transformers import AutoConfig, PretrainedConfig

    fields = dict(config)
    # config.json stores inf and nan as {"__float__": "Infinity"}; from_pretrained decodes them.
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)
    if decode is not None:
        fields = decode(fields)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise NotInTransformersError("the config has no model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise NotInTransformersError(f"transformers does not know model_type {model_type!r}")
    return AutoConfig.for_model(model_type, **fields)


def meta_model(config: Any) -> Any:
    """The model transformers trains ``config`` with, built on the meta device.

    The causal LM of its text config's type or of its own type; else (vision-language models
    with no causal LM: qwen3_vl_moe, glm4v_moe, step3p7, ...) the image-text-to-text model of
    its type, or, for a bare text config (``qwen3_vl_moe_text``), that of the composite type
    whose ``text_config`` it is, with default encoders. Encoders are built but not costed
    (:func:`model_shape` skips vision and audio towers).
    """
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    def model_class(mapping: dict[str, str], model_type: Any) -> Any:
        class_name = mapping.get(model_type) if isinstance(model_type, str) else None
        return getattr(transformers, class_name, None) if class_name else None

    model_type = getattr(config, "model_type", None)
    candidates = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        candidates.insert(0, text)
    built = None
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        found = [(model_class(mapping, c.model_type), c) for c in candidates]
        built = next(((cls, c) for cls, c in found if cls is not None), None)
        if built is not None:
            break
    owner = None if built is not None else _composite_owning(config)
    if owner is not None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        # Its defaults, then this text config: the composite would check its encoders'
        # output widths against the text width, and the encoders are not costed.
        composite = CONFIG_MAPPING[owner]()
        composite.text_config = config
        built = model_class(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, owner), composite
    if built is None:
        raise NotInTransformersError(
            f"transformers {transformers.__version__} has no causal LM or image-text-to-text "
            f"model for model_type {model_type!r}"
        )
    cls, cfg = built
    with torch.device("meta"):
        return cls._from_config(cfg)


def _composite_owning(config: Any) -> str | None:
    """The image-text-to-text model type whose ``text_config`` class is ``config``'s class.

    Where several own it, the first by name: they share the text decoder, the only part costed.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    for owner in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if owner not in CONFIG_MAPPING:
            continue
        sub_configs = getattr(CONFIG_MAPPING[owner], "sub_configs", None) or {}
        if sub_configs.get("text_config") is type(config):
            return owner
    return None


__all__ = [
    "NotInTransformersError",
    "UnsupportedModelError",
    "estimator_from_config",
    "estimator_from_model",
    "is_routed_experts",
    "is_readable",
    "meta_model",
    "model_shape",
    "transformers_config",
]
