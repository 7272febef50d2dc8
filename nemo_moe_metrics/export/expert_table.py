"""The ``moe/expert_loads`` table of one step as one array value, end to end.

A step's expert-load table is three arrays: the global layer ids ``[L]``, the routed counts
``[L, E]`` (int64) and each layer's number of experts ``[L]`` (layers may have fewer experts
than the widest; the columns beyond a layer's width are no expert). ``moe.balance`` makes one
:class:`ExpertTable` per table step, checked once, as arrays; the expert-load store and the
alerts read the arrays; only the sinks that want rows (W&B, MLflow, a user's own) build the
rows view ``[layer, expert, tokens, load_percent]``, once, on first use.

It is a read-only sequence of those rows, so code written for the older list of rows (``len``,
iteration, indexing, ``==`` with a list, ``np.array(table)``) keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class ExpertTable(Sequence):
    """One step's expert loads: ``layer_ids [L]``, ``counts [L, E]`` and ``widths [L]`` (int64).

    Rows (the table's columns ``layer, expert, tokens, load_percent``): per layer in order, its
    experts ``0 .. width - 1``; ``load_percent`` is the expert's share of the layer's
    assignments in percent (0 for a layer without any).
    """

    def __init__(self, layer_ids: Any, counts: Any, widths: Any | None = None) -> None:
        """Checks the arrays once (shapes, integer counts >= 0, widths in ``[1, E]``);
        ``widths`` None: every layer has ``E`` experts."""
        ids = np.asarray(layer_ids)
        c = np.asarray(counts)
        if c.ndim != 2 or ids.ndim != 1 or ids.shape[0] != c.shape[0]:
            raise ValueError(
                f"expert table: {ids.shape} layer ids and counts of shape {c.shape}; pass one "
                "layer id per row of a [layers, experts] count array"
            )
        for name, a in (("layer ids", ids), ("counts", c)):
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"expert table: {name} must be integers, got {a.dtype}")
        if c.size and c.min() < 0:
            raise ValueError("expert table: counts must be >= 0")
        if ids.size and ids.min() < 0:
            raise ValueError("expert table: layer ids must be >= 0")
        if widths is None:
            w = np.full(ids.shape[0], c.shape[1], dtype=np.int64)
        else:
            w = np.asarray(widths, dtype=np.int64)
            if w.shape != ids.shape or (w.size and (w.min() < 1 or w.max() > c.shape[1])):
                raise ValueError(
                    f"expert table: widths {w.tolist()} must give each of the {ids.shape[0]} "
                    f"layers between 1 and {c.shape[1]} experts"
                )
        self.layer_ids = ids.astype(np.int64, copy=False)
        self.counts = c.astype(np.int64, copy=False)
        self.widths = w
        self._rows: list[list] | None = None

    @property
    def rows(self) -> list[list]:
        """The rows ``[layer, expert, tokens, load_percent]`` (built on first use, then kept)."""
        if self._rows is None:
            self._rows = self._build_rows()
        return self._rows

    def _build_rows(self) -> list[list]:
        totals = self.counts.sum(axis=1)
        scale = np.divide(100.0, totals, out=np.zeros(totals.shape), where=totals > 0)
        percent = self.counts * scale[:, None]
        rows: list[list] = []
        for layer, width, c, p in zip(
            self.layer_ids.tolist(), self.widths.tolist(), self.counts, percent, strict=True
        ):
            # tolist() converts a layer at once; indexing numpy scalars cell by cell is slower.
            pairs = zip(c[:width].tolist(), p[:width].tolist(), strict=True)
            rows += [[layer, e, n, q] for e, (n, q) in enumerate(pairs)]
        return rows

    def __len__(self) -> int:
        return int(self.widths.sum())

    @overload
    def __getitem__(self, index: int) -> list: ...

    @overload
    def __getitem__(self, index: slice) -> list[list]: ...

    def __getitem__(self, index: int | slice) -> list | list[list]:
        return self.rows[index]

    def __iter__(self) -> Iterator[list]:
        return iter(self.rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ExpertTable):
            return (
                np.array_equal(self.layer_ids, other.layer_ids)
                and np.array_equal(self.widths, other.widths)
                and np.array_equal(self.counts, other.counts)
            )
        if isinstance(other, list | tuple):
            return self.rows == [list(row) for row in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable rows view: like a list, unhashable

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (Ray's object store, a spawned rank's result) as the three arrays only: the
        # rows view, once built, is 3.5x their size and rebuilt on the other side when wanted.
        return {"layer_ids": self.layer_ids, "counts": self.counts, "widths": self.widths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.layer_ids, self.counts, self.widths = (
            state["layer_ids"],
            state["counts"],
            state["widths"],
        )
        self._rows = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(self.rows, dtype=dtype)

    def __repr__(self) -> str:
        return (
            f"ExpertTable({self.layer_ids.size} layers x {self.counts.shape[1]} experts, "
            f"{len(self)} rows)"
        )
