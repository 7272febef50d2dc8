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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def js_divergence(prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits between count rows ``prev`` and ``cur`` (``[..., E]``).

    Each row is normalised to a distribution first, so the layers' token totals may differ.
    Returns one value per row in ``[0, 1]``; NaN for a row where either step routed no token
    (there is no distribution to compare).
    """
    p = np.asarray(prev, dtype=np.float64)
    q = np.asarray(cur, dtype=np.float64)
    if p.shape != q.shape or p.ndim == 0 or p.shape[-1] == 0:
        raise ValueError(
            f"js_divergence needs two count arrays of the same shape [..., experts], got "
            f"{p.shape} and {q.shape}"
        )
    if np.any(p < 0) or np.any(q < 0):
        raise ValueError("expert counts must be >= 0")
    p_tot = p.sum(axis=-1, keepdims=True)
    q_tot = q.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = p / p_tot
        q = q / q_tot
        m = 0.5 * (p + q)
        # 0 * log(0 / m) is 0: np.where drops the NaN/inf of empty cells.
        kl_p = np.where(p > 0, p * np.log2(p / m), 0.0).sum(axis=-1)
        kl_q = np.where(q > 0, q * np.log2(q / m), 0.0).sum(axis=-1)
    js = np.clip(0.5 * (kl_p + kl_q), 0.0, 1.0)
    empty = (p_tot[..., 0] <= 0) | (q_tot[..., 0] <= 0)
    return np.where(empty, np.nan, js)


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
    """

    def __init__(self, min_steps: int) -> None:
        if min_steps < 1:
            raise ValueError(f"a dead-expert streak needs min_steps >= 1, got {min_steps}")
        self.min_steps = int(min_steps)
        self._layer_ids: list[int] | None = None
        self._length: np.ndarray | None = None  # current streak length per cell
        self._first: np.ndarray | None = None  # step at which the current streak began
        self._last_step: int | None = None
        self._finished: list[Streak] = []

    def update(self, step: int, layer_ids: list[int], counts: np.ndarray) -> np.ndarray:
        """Advance by one logged step; returns the current streak length per cell ``[L, E]``."""
        counts = np.asarray(counts)
        layer_ids = [int(la) for la in layer_ids]
        if (
            self._length is None
            or layer_ids != self._layer_ids
            or counts.shape != self._length.shape
        ):
            self._close_all()
            self._layer_ids = layer_ids
            self._length = np.zeros(counts.shape, dtype=np.int64)
            self._first = np.zeros(counts.shape, dtype=np.int64)
        dead = (counts == 0) & (counts.sum(axis=1, keepdims=True) > 0)
        ended = (self._length >= self.min_steps) & ~dead
        if ended.any():
            self._record(ended, ongoing=False)
        starts = dead & (self._length == 0)
        self._first[starts] = step
        self._length = np.where(dead, self._length + 1, 0)
        self._last_step = int(step)
        return self._length

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
