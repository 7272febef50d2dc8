"""Expert counts over logged steps, accumulated one step at a time in bounded memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_moe_metrics.moe.timeline import DeadStreaks, Drift
from nemo_moe_metrics.report.reading import ReportError

# The over-steps picture keeps at most this many step bins (tokens summed within a bin) ...
_MAX_BINS = 512
# ... and at most this much memory for them, whatever the model's shape.
_BIN_BYTES = 256 << 20


class StepBins:
    """Step bins of summed counts ``[bins, L, E]`` for a run of unknown length: when the bins
    are full, neighbours merge pairwise and each bin covers twice as many logged steps."""

    def __init__(self, shape: tuple[int, int]) -> None:
        cells = max(1, shape[0] * shape[1])
        n = int(min(_MAX_BINS, max(16, _BIN_BYTES // (8 * cells))))
        self.n = n - n % 2
        self.sums = np.zeros((self.n, *shape), dtype=np.int64)
        self.first = np.zeros(self.n, dtype=np.int64)
        self.last = np.zeros(self.n, dtype=np.int64)
        self.size = np.zeros(self.n, dtype=np.int64)
        self.used = 0
        self.width = 1  # logged steps per bin

    def add(self, step: int, counts: np.ndarray) -> None:
        if self.used and self.size[self.used - 1] < self.width:
            i = self.used - 1
            self.sums[i] += counts
        else:
            if self.used == self.n:
                self._halve()
            i = self.used
            self.used += 1
            self.sums[i] = counts
            self.first[i] = step
            self.size[i] = 0
        self.last[i] = step
        self.size[i] += 1

    def _halve(self) -> None:
        h = self.n // 2
        self.sums[:h] = self.sums[0::2] + self.sums[1::2]
        self.first[:h] = self.first[0::2]
        self.last[:h] = self.last[1::2]
        self.size[:h] = self.size[0::2] + self.size[1::2]
        self.used = h
        self.width *= 2


@dataclass
class Timeline:
    """What the report draws from the expert counts, accumulated one logged step at a time."""

    keep_sum: bool
    dead_steps: int
    layer_ids: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    moi: list[np.ndarray] = field(default_factory=list)  # per step: [L] max/ideal (NaN: empty)
    drift: list[np.ndarray] = field(default_factory=list)  # per step after the first: [L]
    heat: np.ndarray | None = None  # the last step's counts, or the window's sum
    bins: StepBins | None = None
    streaks: DeadStreaks | None = None
    _drift: Drift = field(default_factory=Drift)

    def add(self, step: int, layer_ids: Any, counts: np.ndarray) -> None:
        ids = [int(la) for la in layer_ids]
        order = np.argsort(ids, kind="stable")
        if not np.array_equal(order, np.arange(len(ids))):
            ids = [ids[i] for i in order]
            counts = counts[order]
        if not self.steps:
            self.layer_ids = ids
            self.bins = StepBins(counts.shape)
            self.streaks = DeadStreaks(self.dead_steps)
        elif ids != self.layer_ids or self.heat is None or counts.shape != self.heat.shape:
            raise ReportError(
                f"step {step} has MoE layers {ids} x {counts.shape[1]} experts but step "
                f"{self.steps[0]} had {self.layer_ids} x {self.heat.shape[1]}; the model changed "
                "within the run: report each part on its own with --steps FIRST:LAST"
            )
        totals = counts.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.moi.append(counts.max(axis=1) * counts.shape[1] / totals)
        js = self._drift.update(counts)
        if self.steps:
            self.drift.append(js)
        if self.keep_sum and self.heat is not None:
            self.heat += counts
        else:
            self.heat = counts.astype(np.int64, copy=self.keep_sum)
        assert self.bins is not None and self.streaks is not None
        self.bins.add(step, counts)
        self.streaks.update(step, ids, counts)
        self.steps.append(int(step))
