"""A run's expert loads over a window of steps, summed per layer: the input of a plan.

Reads the training store (``expert_loads.bin``) or the rollout store
(``rollout_expert_loads.bin``) in blocks, decoded ahead by up to four threads (zlib releases
the GIL), each block summed over its steps in the decoding thread, so a 10,000-step run at
94 x 256 is read in seconds with a few blocks in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemo_moe_metrics.config.limits import SUM_BOUND
from nemo_moe_metrics.sinks.store import read_expert_load_blocks, store_path

__all__ = ["WindowLoads", "window_loads"]


@dataclass(frozen=True)
class WindowLoads:
    """``weight [L, E]``: tokens per expert of the layers ``layer_ids``, summed over ``steps``
    logged steps from ``first`` to ``last``."""

    layer_ids: np.ndarray
    weight: np.ndarray
    steps: int
    first: int
    last: int
    skipped: list[str]

    @property
    def total(self) -> int:
        """Every expert-token of the window, summed exactly (Python integers: no wrap)."""
        return sum(int(row.sum()) for row in self.weight)


def _sum_block(steps: np.ndarray, ids: np.ndarray, counts: np.ndarray, widths: np.ndarray):
    return int(steps[0]), int(steps[-1]), len(steps), ids, counts.sum(axis=0), widths


def window_loads(
    run_dir: Path, phase: str = "train", first: int | None = None, last: int | None = None
) -> WindowLoads:
    """The summed loads of ``phase`` (``train`` or ``rollout``) in steps ``first..last``
    (inclusive, either end open). Raises ValueError saying what is missing."""
    path = store_path(run_dir, phase)
    if not path.is_file():
        how = (
            "log them with track_moe_metrics and the JSONL sink"
            if phase == "train"
            else "feed them with RolloutLoadRecorder / record_rollout_loads or "
            "`nemo-moe-metrics ingest sglang DUMP --run RUN_DIR --step S`"
        )
        raise ValueError(f"{run_dir} has no {phase} expert loads ({path.name} not found); {how}")
    window = slice(first, None if last is None else last + 1)
    skipped: list[str] = []
    totals: dict[int, np.ndarray] = {}
    widths: dict[int, int] = {}
    n, lo, hi = 0, None, None
    blocks = read_expert_load_blocks(
        path,
        window,
        block=64,
        workers=min(4, os.cpu_count() or 1),
        prepare=_sum_block,
        widths=True,
        skipped=skipped,
    )
    for b_first, b_last, k, ids, summed, w in blocks:
        n += k
        lo = b_first if lo is None else min(lo, b_first)
        hi = b_last if hi is None else max(hi, b_last)
        for row, layer in enumerate(ids.tolist()):
            width = int(w[row])
            if widths.setdefault(layer, width) != width:
                raise ValueError(
                    f"layer {layer} has {widths[layer]} experts in one step and {width} in "
                    "another; plan from a window where it does not change (--steps)"
                )
            acc = totals.get(layer)
            if acc is None:
                acc = totals[layer] = summed[row, :width].astype(np.int64)
            else:
                acc += summed[row, :width]
            # Each count is below 2**53 (the store refuses more), so a block of 64 steps adds
            # less than 2**59: a layer kept below 2**62 cannot wrap on the next block.
            if float(acc.sum(dtype=np.float64)) >= SUM_BOUND:
                raise ValueError(
                    f"{path}: layer {layer}'s tokens summed over steps {lo}–{b_last} pass 2**62 "
                    f"at step {b_last} (more than any run routes); plan from a window of "
                    "fewer steps (--steps) or check the store's counts"
                )
    if not totals:
        if skipped:
            raise ValueError(
                f"no stored {phase} step of {path} could be read: {len(skipped)} record(s) "
                f"skipped ({skipped[0]}{', ...' if len(skipped) > 1 else ''})"
            )
        if first is None and last is None and phase == "train":
            raise ValueError(
                f"{path} holds no {phase} step yet: the run stores its table every "
                "logger.table_every steps and the last step's when it closes; a run still "
                "going, or killed before either, has none. Plan again once it has one"
            )
        span = f"steps {first if first is not None else '…'}–{last if last is not None else '…'}"
        raise ValueError(f"no stored {phase} step in {span} of {path}; widen --steps")
    sizes = sorted(set(widths.values()))
    if len(sizes) > 1:
        raise ValueError(
            f"the MoE layers have different numbers of experts ({sizes}); a plan needs one "
            "expert count for every layer"
        )
    layer_ids = np.array(sorted(totals), dtype=np.int64)
    weight = np.stack([totals[la] for la in layer_ids.tolist()])
    return WindowLoads(layer_ids, weight, n, int(lo), int(hi), skipped)
