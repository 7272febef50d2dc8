"""FLOP shapes read from a built transformers model's modules: every family, no formula needed.

:func:`model_shape` walks the decoder layers of a causal LM once and returns the same
:class:`~nemo_moe_metrics.flops.core.ModelShape` the registered formulas build, so the estimate
uses the same arithmetic and conventions (``flops/core.py``). What each kind of module adds:

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
named where they are handled below and in docs/en/flops.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_moe_metrics.flops.core import (
    LINEAR_ATTENTION_MACS_PER_STATE_ELEMENT,
    AttentionIndexer,
    AttentionLayer,
    ChunkedWindow,
    CompressedWindow,
    DenseMLP,
    FlopsEstimator,
    Layer,
    LinearAttentionLayer,
    MambaLayer,
    ModelShape,
    MoEMLP,
    PooledWindow,
    ShortConvLayer,
    Window,
)
from nemo_moe_metrics.flops.registry import UnknownModelTypeError


class UnsupportedModelError(UnknownModelTypeError):
    """The model holds a module whose FLOPs no rule of :mod:`hf_modules` knows."""


class NotInTransformersError(UnknownModelTypeError):
    """The installed transformers has no causal LM (nor image-text-to-text model) for the
    config's model_type."""


_TOP_K_FIELDS = (
    "top_k",
    "num_experts_per_tok",
    "experts_per_token",
    "num_experts_per_token",
    "moe_topk",
    "moe_k",
    "top_k_experts",
    "moe_top_k",
)
_NUM_EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_ROUTER_CLASS_WORDS = ("Router", "Gating", "TopkGate")
_ROUTER_NAMES = ("gate", "router", "router_gate")
# Parameters with two or more dimensions that are not matmul weights (added, gathered, or
# element-wise), by parameter name.
_NOT_MATMUL = (
    "position_bias",
    "e_score_correction_bias",
    "A_log",
    "sinks",
    "index_kpool_compress_ape",  # GLM-5-Next: added to the pool-gate logits
)
# Parameters used as matmul weights (F.linear) under another name than ``weight``.
_MATMUL = ("index_kpool_compress_gate",)  # GLM-5-Next: per-token pool-gate scores


@dataclass
class _Parts:
    """What one decoder layer holds, in module order."""

    mixers: list[Any] = field(default_factory=list)
    ffns: list[DenseMLP | MoEMLP] = field(default_factory=list)
    other: int = 0


def is_routed_experts(module: Any) -> bool:
    """transformers' experts interface (``adapters.hf_fields``), or an ``...Experts`` module holding
    expert weights (dbrx, llama4)."""
    from nemo_moe_metrics.adapters.hf_fields import is_experts_module

    if is_experts_module(module):
        return True
    name = type(module).__name__
    return name.endswith("Experts") and not name.endswith("SharedExperts")


def _top_k(*sources: Any) -> int | None:
    for source in sources:
        for name in _TOP_K_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _num_experts(experts: Any, *sources: Any) -> int:
    three_d = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
    if three_d:
        return int(three_d[0].shape[0])
    for source in (experts, *sources):
        for name in _NUM_EXPERTS_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise UnsupportedModelError(f"{type(experts).__name__}: cannot tell its number of experts")


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

    # ---- per-token weight matmuls --------------------------------------------------------
    def weight_macs(self, module: Any, top_k: int | None = None, heads: int | None = None) -> int:
        """Multiply-adds per token of every weight matmul in ``module``'s subtree."""
        return sum(self._own_macs(m, name, top_k, heads) for name, m in _named_modules(module))

    def _own_macs(self, module: Any, name: str, top_k: int | None, heads: int | None = None) -> int:
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
            count = _first_int(module, "num_heads") or heads
            if "proj" not in params or count is None:
                raise UnsupportedModelError(f"{self.model_type}: {cls} without proj or heads")
            return int(params["proj"].numel()) * count
        if cls.endswith("DynamicShortConvolution"):
            # Inkling 2: a depthwise conv whose taps are static weights plus per-token ones.
            return int(params["static_weight"].numel())
        if cls.endswith(("HyperConnection", "HyperHead")) and ("fn" in params or "hc_fn" in params):
            return self._hyper_connection(module, params)
        if is_routed_experts(module) and not name.rsplit(".", 1)[-1].startswith("shared"):
            k = _top_k(module) or top_k
            if k is None:
                raise UnsupportedModelError(f"{cls}: cannot tell how many experts a token uses")
            return int(round(k * _expert_weights(module) / _num_experts(module)))
        total = 0
        for pname, p in params.items():
            if p.dim() < 2 or pname in _NOT_MATMUL:
                continue
            if any(word in cls for word in _ROUTER_CLASS_WORDS) or pname in ("weight", *_MATMUL):
                total += p.numel()  # a router's (or a linear-like module's) weight matrix
            elif p.dim() == 3 and cls.endswith("SharedExperts"):
                total += p.numel()  # shared experts stacked in one tensor: all of them run
            else:
                raise UnsupportedModelError(
                    f"{self.model_type}: no FLOP rule for {cls}.{pname} {tuple(p.shape)}; "
                    "register a formula with register_flops_estimator"
                )
        return total

    def _hyper_connection(self, module: Any, params: dict[str, Any]) -> int:
        # Hyper-connections (DeepSeek-V4, HY-V4): one projection of the hc_mult flattened
        # streams to the mixing weights; DeepSeek-V4 also mixes the streams with an
        # hc_mult x hc_mult matrix per token (its Sinkhorn "comb" weights), a matmul.
        fn = params.get("fn", params.get("hc_fn"))
        macs = int(fn.numel())
        if hasattr(module, "hc_sinkhorn_iters"):
            # [hc_mult x hc_mult] @ [hc_mult x hidden]; fn's input is hc_mult x hidden wide.
            macs += int(module.hc_mult) * int(fn.shape[1])
        return macs

    # ---- the model -----------------------------------------------------------------------
    def shape(self) -> ModelShape:
        text_model, layers_list = _decoder_layers(self.model)
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
        for name, module in _named_modules(self.model):
            if id(module) in claimed or _is_tower(name):
                continue
            if multimodal and id(module) not in text_modules:
                continue
            other += self._own_macs(module, name, None)
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
        if _holds_experts(layer):
            # gemma4: the experts and their router are the decoder layer's own children.
            block = self._moe(layer, shared_members=False)
            parts.ffns.append(block)
            children = {n: c for n, c in children.items() if not _in_moe(n, c)}
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
        if _holds_experts(module) or type(module).__name__.endswith("CDMoE"):
            parts.ffns.append(self._moe(module))
            return
        modality_moe = self._modality_moe(module)
        if modality_moe is not None:
            parts.ffns.append(modality_moe)
            return
        mixer = self._mixer(module)
        if mixer is not None:
            parts.mixers.extend(mixer if isinstance(mixer, list) else [mixer])
            return
        if _is_dense_mlp(name, module):
            parts.ffns.append(DenseMLP(self.weight_macs(module)))
            return
        parts.other += self._own_macs(module, name, None)
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
        routers = [c for n, c in children.items() if _is_router(n, c) and c not in experts]
        top_k = _top_k(*routers, block, *experts, self.config)
        if top_k is None:
            raise UnsupportedModelError(f"{self.model_type}: {cls} has no top_k")
        num_experts = _num_experts(experts[0], *routers, block, self.config)
        shared = 0
        if shared_members:
            shared = self._own_macs(block, "", None) + sum(
                self.weight_macs(c) for c in children.values() if c not in experts + routers
            )
        return MoEMLP(
            router_params=sum(self.weight_macs(r) for r in routers),
            expert_params=sum(_expert_weights(e) for e in experts) // num_experts,
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
        moe = {name: child for name, child in children.items() if _holds_experts(child)}
        text = [child for name, child in moe.items() if not _is_tower(name)]
        if len(moe) < 2 or len(text) != 1:
            return None
        ffn = self._moe(text[0])
        shared = self._own_macs(block, "", None) + sum(
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

    # ---- token mixers --------------------------------------------------------------------
    def _mixer(self, module: Any) -> Any:
        cls = type(module).__name__
        if cls.endswith("GatedDeltaNet"):
            return self._delta_rule(
                module, module.num_v_heads, module.head_k_dim, module.head_v_dim
            )
        if cls.endswith("DeltaAttention") or _calls_kernel(type(module), "kimi_delta_attention"):
            # Kimi Delta Attention, whatever the class name (GLM-5-Next: ...LinearAttention).
            return self._delta_rule(module, module.num_heads, module.head_dim, module.head_dim)
        if cls.endswith("LightningAttention"):
            return self._lightning_attention(module)
        if hasattr(module, "A_log") and hasattr(module, "x_proj") and hasattr(module, "dt_proj"):
            return self._mamba(module, module.intermediate_size, 1)  # Mamba-1
        if hasattr(module, "A_log") and hasattr(module, "in_proj") and hasattr(module, "n_groups"):
            return self._mamba(module, module.num_heads, module.head_dim)  # Mamba-2
        if cls.endswith("ShortConv") and hasattr(module, "in_proj"):
            conv = module.conv
            return ShortConvLayer(
                projection_params=self.weight_macs(module) - conv.weight.numel(),
                conv_channels=int(conv.weight.shape[0]),
                conv_kernel=int(conv.weight.shape[-1]),
            )
        if hasattr(module, "scaling") and not cls.endswith("Residual"):
            return self._attention(module)
        return None

    def _conv_split(self, module: Any) -> tuple[int, int, int]:
        """(projection MACs, conv channels, conv kernel) of a mixer with one depthwise conv."""
        conv = module.conv1d
        return (
            self.weight_macs(module) - int(conv.weight.numel()),
            int(conv.weight.shape[0]),
            int(conv.weight.shape[-1]),
        )

    def _delta_rule(self, module: Any, heads: int, key_dim: int, value_dim: int) -> Any:
        """Gated DeltaNet, and Kimi Delta Attention (kimi_linear, bailing_hybrid: the delta rule
        with a per-channel decay): 3 state-sized multiply-adds per token and value head."""
        projections, channels, kernel = self._conv_split(module)
        return LinearAttentionLayer(
            projection_params=projections,
            conv_channels=channels,
            conv_kernel=kernel,
            num_value_heads=int(heads),
            key_head_dim=int(key_dim),
            value_head_dim=int(value_dim),
        )

    def _lightning_attention(self, module: Any) -> LinearAttentionLayer:
        # MiniMax's lightning attention: linear attention with a per-head decay, no conv.
        return LinearAttentionLayer(
            projection_params=self.weight_macs(module),
            conv_channels=0,
            conv_kernel=0,
            num_value_heads=int(module.num_attention_heads),
            key_head_dim=int(module.head_dim),
            value_head_dim=int(module.head_dim),
            core_macs_per_state_element=LINEAR_ATTENTION_MACS_PER_STATE_ELEMENT,
        )

    def _mamba(self, module: Any, heads: int, head_dim: int) -> MambaLayer:
        """Mamba-2 (SSD), or Mamba-1 (jamba) as Mamba-2 with one channel per head (a diagonal
        state of ssm_state_size per channel): write x B into the state, read h C."""
        projections, channels, kernel = self._conv_split(module)
        return MambaLayer(
            projection_params=projections,
            conv_channels=channels,
            conv_kernel=kernel,
            num_heads=int(heads),
            head_dim=int(head_dim),
            state_dim=int(module.ssm_state_size),
        )

    def _attention(self, module: Any) -> AttentionLayer:
        config = self.config
        heads = _first_int(module, "num_heads", "num_attention_heads") or int(
            config.num_attention_heads
        )
        qk = _first_int(module, "qk_head_dim", "head_dim")
        v = _first_int(module, "v_head_dim", "head_dim")
        if qk is None or v is None:
            raise UnsupportedModelError(
                f"{self.model_type}: {type(module).__name__} has no head_dim / qk_head_dim"
            )
        window = self._window(module)
        if (
            self._layer_type(module) == "indexed_attention"
            and getattr(module, "indexer", None) is None
        ):
            # HY-V4, GLM-5-Next: a layer whose indexer is "shared" reuses an earlier layer's
            # top-k keys.
            shared_top_k = _first_int(self.config, "index_topk")
            if shared_top_k is not None:
                window = _top_k_window(self.config, shared_top_k)
        keep = _first_int(module, "keep_window_size")
        if keep is not None:  # doge: each query keeps its top keep_window_size visible keys
            window = keep if not isinstance(window, int) else min(window, keep)
        projections = self.weight_macs(module, _top_k(*_experts_parents(module)), heads)
        indexer = None
        indexer_module = getattr(module, "indexer", None)
        if indexer_module is not None:
            indexer, keep = self._indexer(indexer_module, kv_compression=1, query_head_dim=qk)
            window = _top_k_window(indexer_module, keep)
            projections -= indexer.projection_params
        compressor = getattr(module, "compressor", None)
        if compressor is None or not hasattr(compressor, "compress_rate"):
            return AttentionLayer(projections, heads, qk, v, window, indexer=indexer)
        # DeepSeek-V4: besides its sliding window, a query attends to compressed entries, one
        # per compress_rate tokens (HCA: all of them; CSA: the indexer's top index_topk).
        rate = int(compressor.compress_rate)
        keep = None
        compressed_indexer = None
        compressor_macs = self.weight_macs(compressor)
        projections -= compressor_macs
        inner = getattr(compressor, "indexer", None)
        if inner is not None:
            compressed_indexer, keep = self._indexer(inner, kv_compression=rate, query_head_dim=qk)
            compressor_macs -= compressed_indexer.projection_params
        local = AttentionLayer(projections, heads, qk, v, window)
        compressed = AttentionLayer(
            compressor_macs, heads, qk, v, CompressedWindow(rate, keep), indexer=compressed_indexer
        )
        return [local, compressed]

    def _layer_type(self, module: Any) -> str | None:
        """The config's ``layer_types`` entry of an attention module's layer, if any."""
        layer_types = getattr(self.config, "layer_types", None) or ()
        index = getattr(module, "layer_idx", None)
        return layer_types[index] if isinstance(index, int) and index < len(layer_types) else None

    def _window(self, module: Any) -> Window:
        """The keys a query of this attention module sees, as the model's masks decide:

        1. a module's ``is_sliding`` flag (with its or the config's ``sliding_window``);
        2. a module's own ``sliding_window`` attribute (None there: full attention);
        3. its layer type in the config: ``chunked_attention`` (Llama 4),
           ``reference_sliding_attention`` (full over the prefill, i.e. in training), and, when
           the config's ``layer_types`` name sliding layers, sliding or full by layer;
        4. otherwise the config's ``sliding_window`` on every layer (the Mistral convention:
           Mixtral, MiniMax), unless ``use_sliding_window`` is off or the modeling code never
           builds a sliding-window mask (Nemotron-H's config has the field, unused).
        """
        config = self.config
        size = _first_int(module, "sliding_window") or _first_int(
            config, "sliding_window", "sliding_window_size"
        )
        if hasattr(module, "is_sliding"):
            return size if module.is_sliding else None
        if hasattr(module, "sliding_window"):
            return _first_int(module, "sliding_window")
        layer_types = list(getattr(config, "layer_types", None) or ())
        layer_type = self._layer_type(module)
        if layer_type == "chunked_attention":
            return ChunkedWindow(int(config.attention_chunk_size))
        if layer_type == "reference_sliding_attention":
            # unlimited_ocr's R-SWA: every prefill token stays visible and the window applies
            # to decoded tokens only; a training forward is all prefill: full causal attention.
            return None
        if "sliding_attention" in layer_types:
            return size if layer_type == "sliding_attention" else None
        if getattr(config, "use_sliding_window", True) is False:
            return None
        return size if _builds_sliding_masks(type(module).__module__) else None

    def _indexer(
        self, module: Any, kv_compression: int, query_head_dim: int
    ) -> tuple[AttentionIndexer, int]:
        """A sparse-attention indexer and the number of keys (tokens) a query keeps.

        transformers' indexers return only top-k positions (DSA, DeepSeek-V4) or a mask
        (Qwen4's QSA, Kolibri 1.1), so no gradient reaches them: their forward is counted once.
        Kolibri 1.1's indexer has no weights: it scores with the attention's first query heads
        and keeps its top keys plus sink and local tokens (its pool selection, which scores
        block summaries once per pool, is not counted).
        """
        heads = _first_int(module, "n_heads", "num_heads", "index_n_heads")
        head_dim = _first_int(module, "head_dim", "index_head_dim") or query_head_dim
        # Compressed keys scored: Qwen4's QSA blocks, GLM-5-Next's k-pools.
        compress = _first_int(module, "compress_ratio", "index_kpool") or 1
        keep = _first_int(module, "index_topk", "token_budget")
        if keep is None and hasattr(module, "num_local_tokens"):
            keep = int(module.topk) + int(module.num_local_tokens) + int(module.num_sink_tokens)
        if heads is None or head_dim is None or keep is None:
            raise UnsupportedModelError(
                f"{self.model_type}: {type(module).__name__} has no heads / head_dim / top-k"
            )
        indexer = AttentionIndexer(
            projection_params=self.weight_macs(module),
            num_heads=heads,
            head_dim=head_dim,
            kv_compression=kv_compression * compress,
            trained=False,
        )
        # Where the keys are compressed (DeepSeek-V4) index_topk counts compressed entries.
        return indexer, keep


def _expert_weights(experts: Any) -> int:
    """The matmul weights of all experts of an experts module (biases and norms left out)."""
    return sum(
        p.numel()
        for module in experts.modules()
        if "Norm" not in type(module).__name__
        for n, p in module.named_parameters(recurse=False)
        if p.dim() >= 2 and "bias" not in n
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


@functools.cache
def _builds_sliding_masks(modeling_module: str) -> bool:
    """Whether a modeling module's code mentions sliding windows at all."""
    try:
        return "sliding_window" in inspect.getsource(importlib.import_module(modeling_module))
    except (OSError, TypeError, ImportError):
        return True  # no source to read: trust the config


def _top_k_window(source: Any, keep: int) -> Window:
    """The keys a query keeps when an indexer picks its top ``keep``: those, or, where the
    indexer picks pools of ``index_kpool`` keys (GLM-5-Next; ``source``: the indexer or the
    config), whole pools plus the query's incomplete last pool."""
    pool = _first_int(source, "index_kpool")
    if pool is None or pool == 1:
        return keep
    tail = bool(getattr(source, "index_kpool_always_select_tail", True))
    return PooledWindow(pool, keep, tail=tail)


@functools.cache
def _calls_kernel(module_class: type, kernel: str) -> bool:
    """Whether a module class's forward calls a function whose name ends with ``kernel``."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError, AttributeError):
        return False
    return f"{kernel}(" in source


def _experts_parents(module: Any) -> list[Any]:
    return [m for m in module.modules() if any(is_routed_experts(c) for c in m.children())]


def _first_int(module: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _is_router(name: str, module: Any) -> bool:
    cls = type(module).__name__
    return name in _ROUTER_NAMES or any(w in cls for w in _ROUTER_CLASS_WORDS)


def _holds_experts(module: Any) -> bool:
    return any(is_routed_experts(c) for c in module.children())


def _in_moe(name: str, module: Any) -> bool:
    """A decoder layer's own experts or router (gemma4)."""
    return is_routed_experts(module) or _is_router(name, module)


def _is_dense_mlp(name: str, module: Any) -> bool:
    cls = type(module).__name__
    return name in ("mlp", "feed_forward", "ffn") or cls.endswith(("MLP", "Mlp", "FeedForward"))


def _is_tower(name: str) -> bool:
    return any(word in name for word in ("vision", "audio", "visual", "multi_modal"))


def _named_modules(module: Any) -> Iterator[tuple[str, Any]]:
    return module.named_modules(remove_duplicate=False)


def _decoder_layers(model: Any) -> tuple[Any, list[Any]]:
    """The text model and its decoder layers: the first ModuleList of the classes transformers
    keeps unsplit (else the longest one named ``layers``), outside any vision or audio tower."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    best: tuple[Any, list[Any]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or _is_tower(name) or not len(module):
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if all(type(m).__name__ in no_split for m in module):
            return owner, list(module)
        if "layers" in name.rsplit(".", 1)[-1] and (best is None or len(module) > len(best[1])):
            best = owner, list(module)
    if best is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers found")
    return best


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
