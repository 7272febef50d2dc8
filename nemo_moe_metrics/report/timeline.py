"""Expert counts over logged steps, accumulated one step at a time in bounded memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import SUM_BOUND
from nemo_moe_metrics.moe.load_over_steps import (
    DeadStreaks,
    entropy_from_counts,
    js_from_shares,
    real_experts,
    shares,
)
from nemo_moe_metrics.report.reading import ReportError

# The over-steps picture keeps at most this many step bins (tokens summed within a bin) ...
_MAX_BINS = 512
# ... and at most this much memory for them, whatever the model's shape.
_BIN_BYTES = 256 << 20


class _Overflow(ValueError):
    """A sum of counts over steps that passed 2**62: ``row`` (a layer's row) and ``step``."""

    def __init__(self, row: int, step: int) -> None:
        super().__init__(row, step)
        self.row, self.step = row, step


def _room(sums: np.ndarray, step: int) -> None:
    """:class:`_Overflow` when a layer's row of ``sums [L, E]`` reached 2**62: one more
    block (each count below 2**53, a block of steps below 2**59) could then wrap int64."""
    rows = sums.sum(axis=-1, dtype=np.float64)
    if rows.size and rows.max() >= SUM_BOUND:
        raise _Overflow(int(np.argmax(rows)), step)


def bin_width(logged: int, max_bins: int = _MAX_BINS) -> int:
    """The logged steps per bin that :class:`StepBins` ends with after ``logged`` steps in at
    most ``max_bins`` bins: the smallest power of two ``w`` with ``ceil(logged / w) <=
    max_bins``. Its bins are the consecutive runs of ``w`` logged steps (the last may be
    shorter), whatever order the merges happened in."""
    width = 1
    while -(-logged // width) > max(1, max_bins):
        width *= 2
    return width


class StepBins:
    """Step bins of summed counts ``[bins, L, E]`` for a run of unknown length: when the bins
    are full, neighbours merge pairwise and each bin covers twice as many logged steps, so
    the bins are always runs of :func:`bin_width` logged steps. ``max_bins`` lowers the
    number of bins (default: up to 512, as many as 256 MiB of counts hold)."""

    def __init__(self, shape: tuple[int, int], max_bins: int | None = None) -> None:
        cells = max(1, shape[0] * shape[1])
        n = int(min(_MAX_BINS, max(16, _BIN_BYTES // (8 * cells))))
        if max_bins is not None:
            n = min(n, max(2, int(max_bins)))
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
                self.halve()
            i = self.used
            self.used += 1
            self.sums[i] = counts
            self.first[i] = step
            self.size[i] = 0
        self.last[i] = step
        self.size[i] += 1

    def add_block(self, steps: np.ndarray, counts: np.ndarray) -> None:
        """``add`` for each of ``K`` steps ``[K]`` with counts ``[K, L, E]``: the steps that
        fall into one bin are summed in one operation."""
        i, k = 0, len(steps)
        while i < k:
            if self.used and self.size[self.used - 1] < self.width:
                b = self.used - 1
                n = min(int(self.width - self.size[b]), k - i)
                self.sums[b] += counts[i : i + n].sum(axis=0)
            else:
                if self.used == self.n:
                    self.halve()
                b = self.used
                self.used += 1
                n = min(self.width, k - i)
                self.sums[b] = counts[i : i + n].sum(axis=0)
                self.first[b] = steps[i]
                self.size[b] = 0
            self.last[b] = steps[i + n - 1]
            self.size[b] += n
            i += n
            _room(self.sums[b], int(self.last[b]))

    def halve(self) -> None:
        """Merge neighbouring bins pairwise (each then covers twice as many logged steps); an
        odd last bin stays alone, and the next steps fill it up to the new width."""
        used, pairs = self.used, self.used // 2
        ends = slice(1, 2 * pairs, 2)
        self.sums[:pairs] = self.sums[0 : 2 * pairs : 2] + self.sums[ends]
        self.size[:pairs] = self.size[0 : 2 * pairs : 2] + self.size[ends]
        self.first[:pairs] = self.first[0 : 2 * pairs : 2]
        self.last[:pairs] = self.last[ends]
        for b in range(pairs):
            _room(self.sums[b], int(self.last[b]))
        if used % 2:  # the odd bin out moves down unchanged
            for a in (self.sums, self.size, self.first, self.last):
                a[pairs] = a[used - 1]
        self.used = pairs + used % 2
        self.width *= 2


@dataclass
class Block:
    """``K`` consecutive logged steps of one set of MoE layers, with the per-step arithmetic
    done (``prepare_block``, which may run in a reader thread): rows in layer order."""

    steps: np.ndarray  # [K]
    layer_ids: list[int]  # ascending
    counts: np.ndarray  # [K, L, E]
    moi: np.ndarray  # [K, L] max/ideal (NaN: the layer routed nothing)
    js: np.ndarray  # [K - 1, L] drift between consecutive steps of the block
    first: tuple[np.ndarray, np.ndarray]  # shares [L, E] and entropies [L] of the first step
    last: tuple[np.ndarray, np.ndarray]  # ... and of the last step
    #: each layer's number of experts [L] when the layers differ (columns beyond are 0 and no
    #: expert); None: every layer has all E
    widths: np.ndarray | None = None


def prepare_block(steps: Any, layer_ids: Any, counts: np.ndarray, widths: Any = None) -> Block:
    """Sort the layers, then max/ideal, shares, entropies and drift of ``counts`` ``[K, L, E]``
    in whole-array operations (numpy releases the GIL: reader threads can run this).
    ``widths``: each layer's number of experts (the store's ``.widths``); max/ideal uses the
    layer's own (``max * E_layer / total``); padding columns change no share or entropy."""
    ids = [int(la) for la in layer_ids]
    # None when every layer has every column: the uniform arithmetic, at no extra cost.
    widths = None if real_experts(widths, counts.shape[2]) is None else np.asarray(widths)
    order = np.argsort(ids, kind="stable")
    if not np.array_equal(order, np.arange(len(ids))):
        ids = [ids[i] for i in order]
        counts = counts[:, order]
        widths = None if widths is None else widths[order]
    totals = counts.sum(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        moi = counts.max(axis=2) * (counts.shape[2] if widths is None else widths) / totals
    p = shares(counts)
    h = entropy_from_counts(counts)
    js = js_from_shares(p[:-1], h[:-1], p[1:], h[1:])
    return Block(
        steps=np.asarray(steps, dtype=np.int64),
        layer_ids=ids,
        counts=counts,
        moi=moi,
        js=js,
        first=(p[0].copy(), h[0].copy()),
        last=(p[-1].copy(), h[-1].copy()),
        widths=None if widths is None else widths.astype(np.int64),
    )


@dataclass
class Timeline:
    """What the report draws from the expert counts, accumulated one block of logged steps at
    a time."""

    keep_sum: bool
    dead_steps: int
    layer_ids: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    moi: list[np.ndarray] = field(default_factory=list)  # per step: [L] max/ideal (NaN: empty)
    drift: list[np.ndarray] = field(default_factory=list)  # per step after the first: [L]
    heat: np.ndarray | None = None  # the last step's counts, or the window's sum
    bins: StepBins | None = None
    streaks: DeadStreaks | None = None
    #: each layer's number of experts when the layers differ; None: every layer has all
    widths: np.ndarray | None = None
    _prev: tuple[np.ndarray, np.ndarray] | None = None  # last step's shares and entropies

    def add(self, step: int, layer_ids: Any, counts: np.ndarray, widths: Any = None) -> None:
        """One logged step's counts ``[L, E]`` (``widths``: each layer's number of experts)."""
        self.add_block(prepare_block([step], layer_ids, np.asarray(counts)[None], widths))

    def add_block(self, block: Block) -> None:
        """``K`` logged steps at once (from ``prepare_block``), after the steps already added."""
        ids, counts = block.layer_ids, block.counts
        if not len(block.steps):
            return
        if not self.steps:
            self.layer_ids = ids
            self.widths = block.widths
            self.bins = StepBins(counts.shape[1:])
            self.streaks = DeadStreaks(self.dead_steps)
        elif (
            ids != self.layer_ids
            or self.heat is None
            or counts.shape[1:] != self.heat.shape
            or not _same(block.widths, self.widths)
        ):
            now = _experts_text(block.widths, counts.shape[2])
            before = _experts_text(self.widths, self.heat.shape[1] if self.heat is not None else 0)
            raise ReportError(
                f"step {int(block.steps[0])} has MoE layers {_short(ids)} x {now} experts but "
                f"step {self.steps[0]} had {_short(self.layer_ids)} x {before}; the "
                "model changed within the run: report each part on its own with --steps FIRST:LAST"
            )
        first = self.steps[0] if self.steps else int(block.steps[0])
        try:
            self._accumulate(block)
        except _Overflow as err:
            raise ReportError(
                f"layer {ids[err.row]}'s tokens summed over steps {first}–{err.step} pass 2**62 "
                "(more than any run routes): report a shorter window with --steps FIRST:LAST, "
                "or check the store's counts"
            ) from None

    def _accumulate(self, block: Block) -> None:
        ids, counts = block.layer_ids, block.counts
        self.moi.extend(block.moi)
        if self._prev is not None:
            self.drift.append(js_from_shares(*self._prev, *block.first))
        self.drift.extend(block.js)
        self._prev = block.last
        if self.keep_sum:
            summed = counts.sum(axis=0)
            self.heat = summed if self.heat is None else self.heat + summed
            _room(self.heat, int(block.steps[-1]))
        else:
            self.heat = counts[-1].copy()
        assert self.bins is not None and self.streaks is not None
        self.bins.add_block(block.steps, counts)
        self.streaks.update_block(block.steps, ids, counts, self.widths)
        self.steps.extend(int(s) for s in block.steps)

    def layer_widths(self) -> np.ndarray:
        """Each layer's number of experts ``[L]`` (the widest for every layer when uniform)."""
        if self.widths is not None:
            return self.widths
        n = self.heat.shape[1] if self.heat is not None else 0
        return np.full(len(self.layer_ids), n, dtype=np.int64)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _short(values: Any, most: int = 8) -> str:
    """``[1, 2, 3, ..., 94] (94)``: a list shown in a bounded line, whatever its length."""
    values = [int(v) for v in values]
    if len(values) <= most:
        return str(values)
    head = ", ".join(map(str, values[: most - 1]))
    return f"[{head}, ..., {values[-1]}] ({len(values)})"


def _experts_text(widths: np.ndarray | None, n_experts: int) -> str:
    return str(n_experts) if widths is None else _short(widths.tolist())
