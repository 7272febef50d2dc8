"""Model shapes, the vectorised FLOP arithmetic and the estimator object.

Conventions (stated once, used everywhere in this package):

- One multiply-add is 2 FLOPs: a ``[T, k] @ [k, n]`` matmul costs ``2 * T * k * n``.
- Training FLOPs are ``3 x forward``: the backward pass computes the input gradient and the
  weight gradient, each as expensive as the forward matmul.
- Counted: every matmul with a weight (projections, MLPs, experts actually routed to, routers,
  gates, the lm_head), the attention score and value products, sparse-attention indexers, the
  short convolutions of linear-attention, Mamba and short-conv mixers and the recurrences
  (recurrent-equivalent, see ``linear_attention_core`` and ``mamba_core`` below).
  Multi-token-prediction layers (``ModelShape.mtp_layers``) count as Megatron-LM counts them: per
  layer its transformer layer, its ``2h -> h`` projection (``mtp_projection``) and one more lm_head.
- Not counted: embedding lookups, norms, activations, softmax, rotary embeddings, residual
  adds, biases, the loss. They are memory-bound and together well under 1% of the total for
  the models this package targets.
- Packed batches: attention is summed per sequence, never estimated on the packed total.

This module is pure numpy arithmetic: no torch, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Component keys of FlopsBreakdown.by_component (the contract; keep stable).
ATTENTION_PROJECTIONS = "attention_projections"
ATTENTION_CORE = "attention_core"
LINEAR_ATTENTION_PROJECTIONS = "linear_attention_projections"
LINEAR_ATTENTION_CONV = "linear_attention_conv"
LINEAR_ATTENTION_CORE = "linear_attention_core"
MAMBA_PROJECTIONS = "mamba_projections"
MAMBA_CONV = "mamba_conv"
MAMBA_CORE = "mamba_core"
SHORT_CONV_PROJECTIONS = "short_conv_projections"
SHORT_CONV = "short_conv"
INDEXER = "indexer"
DENSE_MLP = "dense_mlp"
ROUTER = "router"
ROUTED_EXPERTS = "routed_experts"
SHARED_EXPERTS = "shared_experts"
MTP_PROJECTION = "mtp_projection"
OTHER_PROJECTIONS = "other_projections"
LM_HEAD = "lm_head"
COMPONENTS: tuple[str, ...] = (
    ATTENTION_PROJECTIONS,
    ATTENTION_CORE,
    INDEXER,
    LINEAR_ATTENTION_PROJECTIONS,
    LINEAR_ATTENTION_CONV,
    LINEAR_ATTENTION_CORE,
    MAMBA_PROJECTIONS,
    MAMBA_CONV,
    MAMBA_CORE,
    SHORT_CONV_PROJECTIONS,
    SHORT_CONV,
    DENSE_MLP,
    ROUTER,
    ROUTED_EXPERTS,
    SHARED_EXPERTS,
    MTP_PROJECTION,
    OTHER_PROJECTIONS,
    LM_HEAD,
)

# Forward + backward = 3 x forward; a multiply-add = 2 FLOPs.
TRAINING_MULTIPLIER = 3.0
FLOPS_PER_MAC = 2.0
# Recurrent-equivalent Gated DeltaNet forward cost per token and value head, in units of
# key_dim * value_dim multiply-adds: read S^T k, write the delta outer product, read S^T q.
GDN_CORE_MACS_PER_STATE_ELEMENT = 3.0
# Recurrent-equivalent Mamba-2 (SSD) forward cost per token and head, in units of
# head_dim * state_dim multiply-adds: write the x B^T outer product into the state, read h C.
MAMBA_CORE_MACS_PER_STATE_ELEMENT = 2.0
# Recurrent-equivalent linear attention without the delta rule (MiniMax's lightning attention):
# write the k v^T outer product into the state, read S^T q.
LINEAR_ATTENTION_MACS_PER_STATE_ELEMENT = 2.0


@dataclass(frozen=True)
class ChunkedWindow:
    """Chunked attention (Llama 4): the sequence is cut into chunks of ``size`` tokens and a
    query sees the keys of its own chunk up to itself."""

    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"a chunked window needs size > 0, got {self.size}")


@dataclass(frozen=True)
class CompressedWindow:
    """Compressed keys (DeepSeek-V4's compressed attention): one key per ``rate`` tokens. The
    query at position ``t`` (0-based) sees the keys of the complete blocks up to it,
    ``floor((t+1) / rate)`` of them, or at most ``keep`` (the top-k an indexer picks)."""

    rate: int
    keep: int | None = None

    def __post_init__(self) -> None:
        if self.rate <= 0 or (self.keep is not None and self.keep <= 0):
            raise ValueError(f"a compressed window needs rate > 0 and keep > 0, got {self}")


@dataclass(frozen=True)
class PooledWindow:
    """Top-k over pools of ``pool`` consecutive keys (GLM-5-Next's k-pool DSA indexer): the
    query at position ``t`` (0-based) keeps the keys of the complete pools up to it, at most
    ``keep // pool`` of them, and, with ``tail``, the ``(t+1) mod pool`` keys of its incomplete
    last pool: ``min(t+1, keep + (t+1) mod pool)`` keys when ``pool`` divides ``keep``."""

    pool: int
    keep: int
    tail: bool = True

    def __post_init__(self) -> None:
        if self.pool <= 0 or self.keep < self.pool:
            raise ValueError(f"a pooled window needs pool > 0 and keep >= pool, got {self}")


Window = int | ChunkedWindow | CompressedWindow | PooledWindow | None


@dataclass(frozen=True)
class AttentionIndexer:
    """A sparse-attention indexer (DeepSeek's lightning indexer): its own projections, and a
    score for every causal query-key pair from which each query keeps its top keys.

    A pair costs ``num_heads * (head_dim + 1)`` multiply-adds: one ``q . k`` per head, then the
    per-head weighting of the scores. ``kv_compression``: the keys it scores are compressed,
    one per ``kv_compression`` tokens (DeepSeek-V4, Qwen4's QSA blocks; see
    :class:`CompressedWindow`). ``trained=False``: no gradient reaches it (transformers'
    indexers only return the positions they pick), so its forward is counted once, not 3 times.
    """

    projection_params: int
    num_heads: int
    head_dim: int
    kv_compression: int = 1
    trained: bool = True


@dataclass(frozen=True)
class AttentionLayer:
    """A softmax attention layer: its projection weights and its score/value product sizes.

    ``window`` is the number of keys a query sees under a sliding window (itself included,
    the Hugging Face convention), or at most (the top-k keys of sparse attention), or a
    :class:`ChunkedWindow`, :class:`CompressedWindow` or :class:`PooledWindow`; None means full
    causal attention.
    ``indexer``: the sparse-attention indexer that picks the keys, if any.
    """

    projection_params: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    window: Window = None
    indexer: AttentionIndexer | None = None


@dataclass(frozen=True)
class LinearAttentionLayer:
    """A linear-attention layer: projections, depthwise causal conv, a matrix-state recurrence.

    Gated DeltaNet and Kimi Delta Attention (the delta rule: 3 state-sized multiply-adds per
    token and value head); linear attention without the delta rule (MiniMax's lightning
    attention, ``core_macs_per_state_element=2``, no conv: ``conv_channels=0``).
    """

    projection_params: int
    conv_channels: int
    conv_kernel: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    core_macs_per_state_element: float = GDN_CORE_MACS_PER_STATE_ELEMENT


@dataclass(frozen=True)
class MambaLayer:
    """A Mamba-2 mixer: in/out projections, depthwise causal conv over x, B, C, the SSD scan."""

    projection_params: int
    conv_channels: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_dim: int


@dataclass(frozen=True)
class ShortConvLayer:
    """A gated short-convolution mixer (LFM2): in/out projections around a depthwise causal conv."""

    projection_params: int
    conv_channels: int
    conv_kernel: int


@dataclass(frozen=True)
class DenseMLP:
    """A dense MLP; ``params`` are its matmul weights (3 x hidden x width for SwiGLU)."""

    params: int


@dataclass(frozen=True)
class MoEMLP:
    """A routed MoE block: router, ``top_k`` of ``num_experts`` experts, optional shared part.

    ``shared_params`` includes a shared-expert gate (hidden x 1) where the model has one.
    """

    router_params: int
    expert_params: int
    num_experts: int
    top_k: int
    shared_params: int = 0


Mixer = AttentionLayer | LinearAttentionLayer | MambaLayer | ShortConvLayer


@dataclass(frozen=True)
class Layer:
    """One decoder layer: a token mixer and/or a feed-forward block.

    A GPT-style layer has both; a hybrid model's layer (megatron-core ``HybridModel``, one layer
    per pattern symbol) has only one of them, the other is None. ``other_params``: per-token
    weight matmuls and convolutions outside both (hyper-connection mixing, per-layer input
    projections, convolutions on the residual branch), component ``other_projections``.
    """

    mixer: Mixer | None
    ffn: DenseMLP | MoEMLP | None
    other_params: int = 0

    def __post_init__(self) -> None:
        if self.mixer is None and self.ffn is None and not self.other_params:
            raise ValueError("a layer needs a token mixer, a feed-forward block, or both")


@dataclass(frozen=True)
class ModelShape:
    """Everything the FLOP and parameter arithmetic needs about a decoder-only model.

    ``mtp_layers``: the multi-token-prediction layers after the decoder (DeepSeek-V3 style: each
    projects ``[embedding; hidden]`` from ``2h`` to ``h``, runs one transformer layer and the
    shared lm_head once more).
    """

    model_type: str
    hidden_size: int
    layers: tuple[Layer, ...]
    vocab_size: int
    tied_embeddings: bool = False
    #: Per-token weight matmuls outside the decoder layers and the lm_head (a final
    #: hyper-connection collapse, per-layer input projections), component ``other_projections``.
    other_params: int = 0
    mtp_layers: tuple[Layer, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"{self.model_type}: a model needs at least one layer")
        if self.vocab_size < 0 or self.hidden_size <= 0:
            raise ValueError(
                f"{self.model_type}: hidden_size must be > 0 and vocab_size >= 0, got "
                f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"
            )


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters implied by a ModelShape (matmul weights + embeddings; norms/biases excluded)."""

    total: int
    active: int
    embedding: int


@dataclass
class FlopsBreakdown:
    """Training FLOPs of one batch: ``total`` and the same FLOPs split by component."""

    total: float
    by_component: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{"total": ..., "by_component": {...}}``."""
        return {"total": self.total, "by_component": dict(self.by_component)}


def validate_seq_lens(seq_lens: Any) -> np.ndarray:
    """Sequence lengths as a 1-D float64 array; a clear error for anything else.

    Accepts a list/tuple of ints, a numpy integer array or a CPU integer torch tensor.
    """
    if isinstance(seq_lens, (int, np.integer)) and not isinstance(seq_lens, bool):
        raise TypeError(
            f"seq_lens must be a sequence of per-sequence token counts, got the single int "
            f"{int(seq_lens)}; for one sequence pass [{int(seq_lens)}]"
        )
    if type(seq_lens).__module__.startswith("torch"):
        device = getattr(seq_lens, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise TypeError(
                f"seq_lens is a torch tensor on {device}; reading it would synchronise the "
                "device: pass a CPU tensor or a list of ints (e.g. collected once per step)"
            )
        seq_lens = seq_lens.numpy()
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, (Iterable, np.ndarray)):
        raise TypeError(
            f"seq_lens must be a list, tuple, numpy array or CPU torch tensor of ints, got "
            f"{type(seq_lens).__name__}"
        )
    if not isinstance(seq_lens, np.ndarray):
        seq_lens = list(seq_lens)
        # numpy converts in C; the Python scan below runs only to name a bad entry.
        arr = np.asarray(seq_lens) if seq_lens else np.zeros(0, np.int64)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            for i, value in enumerate(seq_lens):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TypeError(
                        f"seq_lens[{i}] = {value!r} is not an integer; sequence lengths are "
                        "token counts (non-negative ints)"
                    )
            raise TypeError(f"seq_lens must hold integers, got dtype {arr.dtype}")
    else:
        arr = seq_lens
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"seq_lens has dtype {arr.dtype}; sequence lengths are token counts: pass an "
                "integer array (e.g. lengths.astype(np.int64))"
            )
    if arr.ndim != 1:
        raise ValueError(
            f"seq_lens must be 1-D (one length per sequence), got shape {tuple(arr.shape)}; "
            "flatten it or pass the per-sequence lengths of the packed batch"
        )
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"seq_lens[{i}] = {int(arr[i])} is negative; lengths must be >= 0")
    return arr.astype(np.float64)


def attended_pairs(lengths: np.ndarray, *, causal: bool, window: Window) -> float:
    """Query-key pairs whose score (and value product) is computed, summed over sequences.

    Non-causal: the full ``L x L`` block per sequence. Causal: ``L(L+1)/2``. Causal with a
    sliding window of ``w`` keys (self included): ``sum_i min(i+1, w)``; chunked attention
    with chunks of ``c``: ``c(c+1)/2`` per full chunk plus ``r(r+1)/2`` for the last ``r``;
    compressed keys (rate ``m``, at most ``k``): ``sum_i min(floor((i+1)/m), k)``, and
    ``L x floor(L/m)`` without the causal mask; pools of ``p`` keys (at most ``k`` keys in
    complete pools, plus the tail): ``sum_i p min(floor((i+1)/p), k // p) + (i+1) mod p``.
    """
    return float(np.sum(pairs_per_sequence(lengths, causal=causal, window=window)))


def pairs_per_sequence(lengths: Any, *, causal: bool, window: Window) -> Any:
    """:func:`attended_pairs` per sequence, element-wise on a numpy array or a torch integer
    tensor (the same arithmetic serves the device-side sums of ``throughput.py``)."""
    if isinstance(window, CompressedWindow):
        rate = int(window.rate)
        entries = lengths // rate
        if not causal:
            return lengths * entries
        # sum over levels v = 1..q of the queries that see at least v entries: L + 1 - v*rate.
        seen = entries if window.keep is None else entries.clip(max=int(window.keep))
        return seen * (lengths + 1) - rate * (seen * (seen + 1) // 2)
    if not causal:
        return lengths * lengths
    if isinstance(window, PooledWindow):
        # Complete pools: a compressed window of rate p and keep // p entries, p keys each.
        pool = int(window.pool)
        seen = (lengths // pool).clip(max=int(window.keep) // pool)
        pooled = pool * (seen * (lengths + 1) - pool * (seen * (seen + 1) // 2))
        if not window.tail:
            return pooled
        # Tails: sum of n mod p over n = 1..L, in (L+1) // p full cycles and a partial one.
        rest = (lengths + 1) % pool
        return pooled + ((lengths + 1) // pool) * (pool * (pool - 1) // 2) + rest * (rest - 1) // 2
    if window is None:
        return lengths * (lengths + 1) // 2  # L(L+1) is even: exact in floats too
    if isinstance(window, ChunkedWindow):
        size = int(window.size)
        full, rest = lengths // size, lengths % size
        return full * (size * (size + 1) // 2) + rest * (rest + 1) // 2
    w = int(window)
    # The first min(L, w) queries see i+1 keys; the remaining ones see exactly w.
    inside = lengths.clip(max=w)
    return inside * (inside + 1) // 2 + (lengths - inside) * w


class FlopsEstimator:
    """Training FLOPs of a model for a batch of sequence lengths: ``est(seq_lens, causal=...)``.

    Built from a ModelShape; the per-token costs are summed once here so a call is a handful
    of numpy reductions over the lengths, whatever the batch size.
    """

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        per_token: dict[str, float] = {}
        # Per-pair widths (multiply-adds per attended pair) by window, then by component, so
        # each distinct window costs one vectorised reduction per call.
        self._pair_groups: dict[Window, dict[str, float]] = {}
        for layer in shape.layers + shape.mtp_layers:
            mixer, ffn = layer.mixer, layer.ffn
            if mixer is None:
                pass
            elif isinstance(mixer, AttentionLayer):
                _add(per_token, ATTENTION_PROJECTIONS, mixer.projection_params)
                width = mixer.num_heads * (mixer.qk_head_dim + mixer.v_head_dim)
                self._add_pairs(mixer.window, ATTENTION_CORE, width)
                if mixer.indexer is not None:
                    self._add_indexer(per_token, mixer.indexer)
            elif isinstance(mixer, MambaLayer):
                _add(per_token, MAMBA_PROJECTIONS, mixer.projection_params)
                _add(per_token, MAMBA_CONV, mixer.conv_channels * mixer.conv_kernel)
                _add(
                    per_token,
                    MAMBA_CORE,
                    MAMBA_CORE_MACS_PER_STATE_ELEMENT
                    * mixer.num_heads
                    * mixer.head_dim
                    * mixer.state_dim,
                )
            elif isinstance(mixer, ShortConvLayer):
                _add(per_token, SHORT_CONV_PROJECTIONS, mixer.projection_params)
                _add(per_token, SHORT_CONV, mixer.conv_channels * mixer.conv_kernel)
            else:
                _add(per_token, LINEAR_ATTENTION_PROJECTIONS, mixer.projection_params)
                if mixer.conv_channels:
                    _add(per_token, LINEAR_ATTENTION_CONV, mixer.conv_channels * mixer.conv_kernel)
                _add(
                    per_token,
                    LINEAR_ATTENTION_CORE,
                    mixer.core_macs_per_state_element
                    * mixer.num_value_heads
                    * mixer.key_head_dim
                    * mixer.value_head_dim,
                )
            if ffn is None:
                pass
            elif isinstance(ffn, DenseMLP):
                _add(per_token, DENSE_MLP, ffn.params)
            else:
                _add(per_token, ROUTER, ffn.router_params)
                _add(per_token, ROUTED_EXPERTS, ffn.top_k * ffn.expert_params)
                if ffn.shared_params:
                    _add(per_token, SHARED_EXPERTS, ffn.shared_params)
            if layer.other_params:
                _add(per_token, OTHER_PROJECTIONS, layer.other_params)
        if shape.other_params:
            _add(per_token, OTHER_PROJECTIONS, shape.other_params)
        mtp = len(shape.mtp_layers)
        if mtp:
            _add(per_token, MTP_PROJECTION, mtp * 2 * shape.hidden_size * shape.hidden_size)
        if shape.vocab_size:
            _add(per_token, LM_HEAD, (1 + mtp) * shape.hidden_size * shape.vocab_size)
        # Per-token multiply-adds -> training FLOPs per token.
        scale = TRAINING_MULTIPLIER * FLOPS_PER_MAC
        self._per_token = {k: v * scale for k, v in per_token.items()}
        paired = {c for group in self._pair_groups.values() for c in group}
        self._components = [c for c in COMPONENTS if c in per_token or c in paired]

    def _add_pairs(self, window: Window, component: str, width: float) -> None:
        group = self._pair_groups.setdefault(window, {})
        group[component] = group.get(component, 0.0) + float(width)

    def _add_indexer(self, per_token: dict[str, float], indexer: AttentionIndexer) -> None:
        # Counted 3x like everything else; an indexer run without gradients only once.
        passes = 1.0 if indexer.trained else 1.0 / TRAINING_MULTIPLIER
        _add(per_token, INDEXER, passes * indexer.projection_params)
        width = indexer.num_heads * (indexer.head_dim + 1)
        window = None if indexer.kv_compression == 1 else CompressedWindow(indexer.kv_compression)
        self._add_pairs(window, INDEXER, passes * width)

    @property
    def components(self) -> list[str]:
        """The by_component keys this model produces, in the canonical order."""
        return list(self._components)

    def __call__(self, seq_lens: Any, *, causal: bool = True) -> FlopsBreakdown:
        """Training FLOPs (forward + backward) of a batch of sequences of these lengths."""
        lengths = validate_seq_lens(seq_lens)
        tokens = float(np.sum(lengths))
        pairs = [
            attended_pairs(lengths, causal=causal, window=window) for window in self._pair_groups
        ]
        return self.from_sums(tokens, pairs)

    @property
    def attention_windows(self) -> tuple[Window, ...]:
        """The distinct attention windows (None = full), in the order :meth:`from_sums` takes."""
        return tuple(self._pair_groups)

    def from_sums(self, tokens: float, pairs: Sequence[float]) -> FlopsBreakdown:
        """Training FLOPs from a batch's sums: its tokens and its attended pairs per window.

        The estimate is linear in these sums (``pairs[j]`` = :func:`attended_pairs` of the
        lengths for ``attention_windows[j]``), so sums taken on the device, or over ranks, give
        the same FLOPs as the lengths themselves.
        """
        if len(pairs) != len(self._pair_groups):
            raise ValueError(
                f"from_sums needs one attended-pair sum per attention window "
                f"{self.attention_windows}, got {len(pairs)}"
            )
        out = {c: 0.0 for c in self._components}
        for key, flops_per_token in self._per_token.items():
            out[key] = flops_per_token * tokens
        scale = TRAINING_MULTIPLIER * FLOPS_PER_MAC
        for widths, pair_sum in zip(self._pair_groups.values(), pairs, strict=True):
            for component, width in widths.items():
                out[component] += scale * width * float(pair_sum)
        return FlopsBreakdown(total=float(sum(out.values())), by_component=out)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token of one sequence of ``seq_len`` tokens."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        return self([seq_len], causal=causal).total / seq_len

    def parameter_counts(self) -> ParameterCounts:
        """Total and per-token active parameters implied by the shape (embeddings included)."""
        shape = self.shape
        embedding = shape.hidden_size * shape.vocab_size * (1 if shape.tied_embeddings else 2)
        total = active = embedding + len(shape.mtp_layers) * 2 * shape.hidden_size**2
        total += shape.other_params
        active += shape.other_params
        for layer in shape.layers + shape.mtp_layers:
            mixer, ffn = layer.mixer, layer.ffn
            mixer_params = layer.other_params
            if mixer is not None:
                mixer_params += mixer.projection_params
            if isinstance(mixer, (LinearAttentionLayer, MambaLayer, ShortConvLayer)):
                mixer_params += mixer.conv_channels * mixer.conv_kernel
            if isinstance(mixer, AttentionLayer) and mixer.indexer is not None:
                mixer_params += mixer.indexer.projection_params
            total += mixer_params
            active += mixer_params
            if ffn is None:
                pass
            elif isinstance(ffn, DenseMLP):
                total += ffn.params
                active += ffn.params
            else:
                common = ffn.router_params + ffn.shared_params
                total += common + ffn.num_experts * ffn.expert_params
                active += common + ffn.top_k * ffn.expert_params
        return ParameterCounts(total=total, active=active, embedding=embedding)


def _add(acc: dict[str, float], key: str, value: float) -> None:
    acc[key] = acc.get(key, 0.0) + float(value)
