"""Expert loads over steps: routing drift and dead-expert streaks. Pure numpy, no torch.distributed.

Shared by the report (a whole run, streamed step by step) and the alert monitor (one step at a
time during training), so both judge a run by the same arithmetic:

- **routing drift**: the Jensen-Shannon divergence, in bits, between a layer's load
  distributions at two consecutive logged steps. 0 means the router sent the same shares to
  every expert; 1 means the two steps used disjoint experts. It is symmetric and finite even
  when an expert got no token at one of the steps (unlike the KL divergence).
- **dead-expert streak**: consecutive logged steps at which an expert got no token while its
  layer routed tokens. A step at which the whole layer routed nothing ends every streak of that
  layer (nothing can be judged, as for ``moe/dead_experts``).

Layers with fewer experts than the widest (``widths``) have zero columns on the right that are
no expert: they are never dead. Shares, entropy and drift need no widths (a zero column adds
nothing to a distribution); max/ideal does (``max * E_layer / total``, see ``real_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def real_experts(widths: Any, n_experts: int) -> np.ndarray | None:
    """``[L, E]`` True where a column is one of its layer's experts (``widths[i]`` of them);
    None when every layer has all ``n_experts`` (no column is padding)."""
    if widths is None:
        return None
    w = np.asarray(widths, dtype=np.int64)
    if not w.size or int(w.min()) >= n_experts:
        return None
    return np.arange(n_experts) < w[:, None]


def shares(counts: np.ndarray) -> np.ndarray:
    """Each row of counts ``[..., E]`` as a distribution over experts; NaN rows where empty."""
    c = np.asarray(counts)
    if c.ndim == 0 or c.shape[-1] == 0:
        raise ValueError(f"expected expert counts of shape [..., experts], got {c.shape}")
    if c.dtype.kind != "u" and c.size and c.min() < 0:
        raise ValueError("expert counts must be >= 0")
    # Row sums in the counts' own type (exact for integers), one dividing pass to float64.
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.true_divide(c, c.sum(axis=-1, keepdims=True), dtype=np.float64)


def entropy_bits(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits of each row of distributions ``p`` (``0 log 0 = 0``; NaN stays)."""
    p = np.asarray(p, dtype=np.float64)
    # log2 of 1 where p is 0 (or NaN): a plain log2 over the whole array, about twice as fast
    # as a masked one (``where=``); p * 0 keeps 0 for empty cells and NaN for NaN rows.
    x = np.where(p > 0, p, 1.0)
    np.log2(x, out=x)
    x *= p
    return -x.sum(axis=-1)


# c * log2(c) for c = 0, 1, 2, ... (grown on demand, shared by threads: a reference swap).
_XLOG2X = np.zeros(1)
# Beyond this count the table (8 bytes per entry) would outgrow the caches: logarithms instead.
_XLOG2X_MAX = 1 << 22


def entropy_from_counts(counts: np.ndarray) -> np.ndarray:
    """``entropy_bits(shares(counts))`` of integer counts ``[..., E]`` (NaN for empty rows).

    ``H = log2 T - sum(c log2 c) / T`` with ``c log2 c`` looked up in a table: one gather per
    cell instead of a logarithm, about 5x faster; equal to the shares' entropy within 1e-13 bits.
    """
    global _XLOG2X
    c = np.asarray(counts)
    if c.dtype.kind not in "iu" or c.size == 0:
        return entropy_bits(shares(c))
    top = int(c.max())
    if top >= _XLOG2X_MAX or (c.dtype.kind == "i" and int(c.min()) < 0):
        return entropy_bits(shares(c))
    table = _XLOG2X
    if top >= table.size:
        x = np.arange(max(top + 1, 2 * table.size), dtype=np.float64)
        x[1:] *= np.log2(x[1:])
        _XLOG2X = table = x
    totals = c.sum(axis=-1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(totals) - np.take(table, c).sum(axis=-1) / totals


def js_divergence(prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits between count rows ``prev`` and ``cur`` (``[..., E]``).

    Each row is normalised to a distribution first, so the layers' token totals may differ.
    Returns one value per row in ``[0, 1]``; NaN for a row where either step routed no token
    (there is no distribution to compare).
    """
    p, q = shares(prev), shares(cur)
    if p.shape != q.shape:
        raise ValueError(
            f"js_divergence needs two count arrays of one shape, got {p.shape}, {q.shape}"
        )
    return js_from_shares(p, entropy_bits(p), q, entropy_bits(q))


def js_from_shares(p: np.ndarray, h_p: np.ndarray, q: np.ndarray, h_q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence (bits) of shares ``p`` and ``q`` ``[..., E]`` whose entropies
    ``h_p``, ``h_q`` (``entropy_bits``) are known: one more logarithm per cell, for the mixture."""
    # JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2; rounding can make it -1e-16, never below 0.
    return np.clip(entropy_bits(0.5 * (p + q)) - 0.5 * (h_p + h_q), 0.0, 1.0)


class Drift:
    """Routing drift of each layer between consecutive steps, one step at a time.

    ``update(counts)`` returns the JS divergence (bits) of each row against the previous call's
    counts (NaN at the first call, for an empty row, or after the layer shape changed).
    Each step's distribution and entropy are computed once and reused for the next pair.
    """

    def __init__(self) -> None:
        self._prev: tuple[np.ndarray, np.ndarray] | None = None

    def update(self, counts: np.ndarray) -> np.ndarray:
        """Divergence of ``counts`` ``[L, E]`` from the previous step's, per row."""
        p = shares(counts)
        h = entropy_bits(p)
        prev, self._prev = self._prev, (p, h)
        if prev is None or prev[0].shape != p.shape:
            return np.full(p.shape[:-1], np.nan)
        return js_from_shares(prev[0], prev[1], p, h)

    def reset(self) -> None:
        """Forget the previous step (the next update has nothing to compare with)."""
        self._prev = None


@dataclass(frozen=True)
class Streak:
    """An expert that got no token for ``length`` consecutive logged steps ``first..last``."""

    layer: int
    expert: int
    first: int
    last: int
    length: int
    ongoing: bool  # still dead at the last step seen


class DeadStreaks:
    """Follows every (layer, expert)'s run of zero-token logged steps, one step at a time.

    ``update(step, layer_ids, counts)`` per logged step, in step order; memory is two integer
    arrays of ``[layers, experts]`` plus the finished streaks of at least ``min_steps`` steps.
    ``widths`` (each layer's number of experts, when the layers differ): columns beyond a
    layer's width are no expert and never dead.
    """

    def __init__(self, min_steps: int) -> None:
        if min_steps < 1:
            raise ValueError(f"a dead-expert streak needs min_steps >= 1, got {min_steps}")
        self.min_steps = int(min_steps)
        self._layer_ids: list[int] | None = None
        self._real: np.ndarray | None = None  # [L, E] real experts; None: every column
        self._length: np.ndarray | None = None  # current streak length per cell
        self._first: np.ndarray | None = None  # step at which the current streak began
        self._last_step: int | None = None
        self._finished: list[Streak] = []

    def update(
        self, step: int, layer_ids: list[int], counts: np.ndarray, widths: Any = None
    ) -> np.ndarray:
        """Advance by one logged step; returns the current streak length per cell ``[L, E]``."""
        counts = np.asarray(counts)
        layer_ids = [int(la) for la in layer_ids]
        real = real_experts(widths, counts.shape[-1])
        if self._changed(layer_ids, counts.shape, real):
            self._close_all()
            self._layer_ids = layer_ids
            self._real = real
            self._length = np.zeros(counts.shape, dtype=np.int64)
            self._first = np.zeros(counts.shape, dtype=np.int64)
        dead = (counts == 0) & (counts.sum(axis=1, keepdims=True) > 0)
        if real is not None:
            dead &= real
        ended = (self._length >= self.min_steps) & ~dead
        if ended.any():
            self._record(ended, ongoing=False)
        starts = dead & (self._length == 0)
        self._first[starts] = step
        self._length = np.where(dead, self._length + 1, 0)
        self._last_step = int(step)
        return self._length

    def update_block(
        self, steps: Any, layer_ids: list[int], counts: np.ndarray, widths: Any = None
    ) -> None:
        """``update`` for each of ``K`` logged steps at once: ``steps`` ``[K]`` in order, counts
        ``[K, L, E]`` of one set of layers. Same streaks as K calls of ``update``; only the
        cells that are dead somewhere in the block or already in a streak are walked step by
        step, so a healthy block costs a few whole-array operations."""
        counts = np.asarray(counts)
        steps = [int(s) for s in steps]
        if not steps:
            return
        layer_ids = [int(la) for la in layer_ids]
        if self._changed(layer_ids, counts.shape[1:], real_experts(widths, counts.shape[-1])):
            self.update(steps[0], layer_ids, counts[0], widths)
            steps, counts = steps[1:], counts[1:]
            if not steps:
                return
        assert self._length is not None and self._first is not None
        k, n_layers, n_experts = counts.shape
        dead = (counts == 0) & (counts.sum(axis=2, keepdims=True) > 0)  # [K, L, E]
        if self._real is not None:
            dead &= self._real
        flat_length = self._length.reshape(-1)
        flat_first = self._first.reshape(-1)
        active = np.flatnonzero(dead.any(axis=0).reshape(-1) | (flat_length > 0))
        if active.size:
            walk = dead.reshape(k, -1)[:, active]  # [K, A]
            length = flat_length[active]
            first = flat_first[active]
            for i, step in enumerate(steps):
                d = walk[i]
                ended = (length >= self.min_steps) & ~d
                if ended.any():
                    last = int(self._last_step) if self._last_step is not None else 0
                    for j in np.flatnonzero(ended):
                        row, expert = divmod(int(active[j]), n_experts)
                        self._finished.append(
                            Streak(
                                layer=self._layer_ids[row],
                                expert=expert,
                                first=int(first[j]),
                                last=last,
                                length=int(length[j]),
                                ongoing=False,
                            )
                        )
                first = np.where(d & (length == 0), step, first)
                length = np.where(d, length + 1, 0)
                self._last_step = step
            flat_length[active] = length
            flat_first[active] = first
        self._last_step = steps[-1]

    def _changed(self, layer_ids: list[int], shape: tuple[int, ...], real: Any) -> bool:
        """Whether a step's layers differ from the ones followed (their streaks then end)."""
        if self._length is None or layer_ids != self._layer_ids or shape != self._length.shape:
            return True
        if real is None or self._real is None:
            return real is not self._real
        return not np.array_equal(real, self._real)

    @property
    def first_steps(self) -> np.ndarray:
        """The step at which each cell's current streak began ``[L, E]`` (meaningless at 0)."""
        if self._first is None:
            raise RuntimeError("no step seen yet; call update() first")
        return self._first

    def streaks(self) -> list[Streak]:
        """Every streak of at least ``min_steps`` logged steps, finished or still running."""
        out = list(self._finished)
        if self._length is not None:
            out += self._collect(self._length >= self.min_steps, ongoing=True)
        return sorted(out, key=lambda s: (s.layer, s.expert, s.first))

    def _collect(self, mask: np.ndarray, *, ongoing: bool) -> list[Streak]:
        # Called before the cells are reset, so _last_step is the streak's last dead step.
        assert self._layer_ids is not None and self._length is not None and self._first is not None
        last = int(self._last_step) if self._last_step is not None else 0
        return [
            Streak(
                layer=self._layer_ids[row],
                expert=int(expert),
                first=int(self._first[row, expert]),
                last=last,
                length=int(self._length[row, expert]),
                ongoing=ongoing,
            )
            for row, expert in zip(*np.nonzero(mask), strict=True)
        ]

    def _record(self, mask: np.ndarray, *, ongoing: bool) -> None:
        self._finished += self._collect(mask, ongoing=ongoing)

    def _close_all(self) -> None:
        if self._length is not None:
            self._record(self._length >= self.min_steps, ongoing=False)
