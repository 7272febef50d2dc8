"""A run's expert counts, step by step: from the expert-load store (``expert_loads.bin``), read
in prepared blocks by reader threads, or from the ``moe/expert_loads`` rows in the JSONL of runs
written before the store existed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import COUNT_BOUND, first_over
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.report.reading import Line, ReportError, Window, read_line
from nemo_moe_metrics.report.timeline import prepare_block
from nemo_moe_metrics.sinks.store import (
    read_expert_load_blocks,
    read_expert_loads,
    store_path,
    table_to_counts_and_widths,
)


def store_blocks(
    run_dir: Path, window: Window | None, skipped: list[str] | None = None
) -> Iterator[Any] | None:
    """The store's logged steps as ``timeline.Block`` s of up to 32 steps, decoded and prepared
    by up to two reader threads while the caller accumulates; None without a store. What the
    reader skipped goes to ``skipped`` (see ``read_expert_load_blocks``)."""
    path = store_path(run_dir)
    if not path.is_file():
        return None
    lo, hi = window if window is not None else (None, None)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return read_expert_load_blocks(
        path,
        slice(lo, None if hi is None else hi + 1),
        workers=max(1, min(2, cpus)),
        prepare=prepare_block,
        widths=True,
        skipped=skipped,
    )


def store_has_steps(run_dir: Path) -> bool:
    """Whether the run directory holds an expert-load store with at least one logged step."""
    path = store_path(run_dir)
    return path.is_file() and next(read_expert_loads(path), None) is not None


def jsonl_table_counts(
    path: Path, lines: list[Line], num_experts: int | None
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """``(step, layer_ids, counts, widths)`` from ``moe/expert_loads`` rows: the JSONL of runs
    from before the store. ``widths`` is each layer's number of experts (its rows'); a table
    of equal layers narrower than ``num_experts`` (run.json's) is widened to it."""
    with path.open("rb") as f:
        for line in lines:
            if not line.has_table:
                continue
            rows = read_line(f, line).get(mn.EXPERT_LOADS)
            if not rows:
                continue
            try:
                layer_ids, counts, widths = table_to_counts_and_widths(rows)
            except (OverflowError, ValueError, TypeError) as err:
                raise ReportError(
                    f"{path}: the moe/expert_loads table of step {line.step} is not "
                    f"one of counts ({err})"
                ) from None
            if first_over(counts) is not None or (
                counts.size and counts.sum(axis=1, dtype=np.float64).max() >= COUNT_BOUND
            ):
                raise ReportError(
                    f"{path}: the moe/expert_loads table of step {line.step} holds a count "
                    "outside 0..2**53-1 (or a layer summing above it); no step routes that many: "
                    "report the steps around it with --steps FIRST:LAST"
                )
            uniform = int(widths.min()) == counts.shape[1]
            if uniform and num_experts and counts.shape[1] < num_experts:
                counts = np.pad(counts, ((0, 0), (0, num_experts - counts.shape[1])))
                widths = np.full_like(widths, num_experts)
            yield line.step, layer_ids, counts, widths
