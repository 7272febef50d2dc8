"""Token mixers of a transformers decoder layer, read from their modules: softmax attention
(its sliding, chunked, pooled or compressed window, sparse-attention indexers), Gated DeltaNet,
Kimi Delta Attention, MiniMax lightning attention, Mamba-1, Mamba-2 and LFM2's short convolutions.

:class:`MixerReader` turns one mixer module into the ``flops.core`` layer it is
(:class:`AttentionLayer`, :class:`LinearAttentionLayer`, :class:`MambaLayer`,
:class:`ShortConvLayer`); the keys a query sees are decided as the model's own masks decide.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from nemo_moe_metrics.flops.core import (
    LINEAR_ATTENTION_MACS_PER_STATE_ELEMENT,
    AttentionIndexer,
    AttentionLayer,
    ChunkedWindow,
    CompressedWindow,
    LinearAttentionLayer,
    MambaLayer,
    PooledWindow,
    ShortConvLayer,
    Window,
)
from nemo_moe_metrics.flops.errors import UnsupportedModelError
from nemo_moe_metrics.flops.hf_module_tree import experts_parents, first_int, top_k_of, weight_macs


class MixerReader:
    """Reads the token mixers of one model (its text config decides windows and layer types)."""

    def __init__(self, config: Any, model_type: str) -> None:
        self.config = config
        self.model_type = model_type

    def weight_macs(self, module: Any, top_k: int | None = None, heads: int | None = None) -> int:
        """Multiply-adds per token of every weight matmul in ``module``'s subtree."""
        return weight_macs(module, self.model_type, top_k, heads)

    def mixer(self, module: Any) -> Any:
        """``module`` as a token mixer (a Layer's mixer, or a list of two for DeepSeek-V4's
        local and compressed attention), or None when it is not one."""
        cls = type(module).__name__
        if cls.endswith("GatedDeltaNet"):
            return self._delta_rule(
                module, module.num_v_heads, module.head_k_dim, module.head_v_dim
            )
        if cls.endswith("DeltaAttention") or calls_kernel(type(module), "kimi_delta_attention"):
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
        heads = first_int(module, "num_heads", "num_attention_heads") or int(
            config.num_attention_heads
        )
        qk = first_int(module, "qk_head_dim", "head_dim")
        v = first_int(module, "v_head_dim", "head_dim")
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
            shared_top_k = first_int(self.config, "index_topk")
            if shared_top_k is not None:
                window = top_k_window(self.config, shared_top_k)
        keep = first_int(module, "keep_window_size")
        if keep is not None:  # doge: each query keeps its top keep_window_size visible keys
            window = keep if not isinstance(window, int) else min(window, keep)
        projections = self.weight_macs(module, top_k_of(*experts_parents(module)), heads)
        indexer = None
        indexer_module = getattr(module, "indexer", None)
        if indexer_module is not None:
            indexer, keep = self._indexer(indexer_module, kv_compression=1, query_head_dim=qk)
            window = top_k_window(indexer_module, keep)
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
        size = first_int(module, "sliding_window") or first_int(
            config, "sliding_window", "sliding_window_size"
        )
        if hasattr(module, "is_sliding"):
            return size if module.is_sliding else None
        if hasattr(module, "sliding_window"):
            return first_int(module, "sliding_window")
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
        return size if builds_sliding_masks(type(module).__module__) else None

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
        heads = first_int(module, "n_heads", "num_heads", "index_n_heads")
        head_dim = first_int(module, "head_dim", "index_head_dim") or query_head_dim
        # Compressed keys scored: Qwen4's QSA blocks, GLM-5-Next's k-pools.
        compress = first_int(module, "compress_ratio", "index_kpool") or 1
        keep = first_int(module, "index_topk", "token_budget")
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


@functools.cache
def builds_sliding_masks(modeling_module: str) -> bool:
    """Whether a modeling module's code mentions sliding windows at all."""
    try:
        return "sliding_window" in inspect.getsource(importlib.import_module(modeling_module))
    except (OSError, TypeError, ImportError):
        return True  # no source to read: trust the config


def top_k_window(source: Any, keep: int) -> Window:
    """The keys a query keeps when an indexer picks its top ``keep``: those, or, where the
    indexer picks pools of ``index_kpool`` keys (GLM-5-Next; ``source``: the indexer or the
    config), whole pools plus the query's incomplete last pool."""
    pool = first_int(source, "index_kpool")
    if pool is None or pool == 1:
        return keep
    tail = bool(getattr(source, "index_kpool_always_select_tail", True))
    return PooledWindow(pool, keep, tail=tail)


@functools.cache
def calls_kernel(module_class: type, kernel: str) -> bool:
    """Whether a module class's forward calls a function whose name ends with ``kernel``."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError, AttributeError):
        return False
    return f"{kernel}(" in source
