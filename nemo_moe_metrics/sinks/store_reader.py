"""Reading the expert-load store: :func:`read_expert_loads` (one step at a time) and
:func:`read_expert_load_blocks` (blocks of steps, optionally decoded ahead by threads), both
walking the headers first and decoding only the steps asked for; the timeline of a resumed run
(later records of a step win); what was skipped, in words. The format is in
:mod:`nemo_moe_metrics.sinks.store_format`.

The headers double as an index: ``read_expert_loads`` first walks the headers (36 bytes read
per step, the payloads are skipped by seeking), then decodes only the steps asked for, one at
a time, so reading a step window of a 10,000-step run neither decodes nor holds the rest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.sinks.store_format import (
    RecordHeader,
    StoreCountError,
    decode_record,
    scan_store,
)

# Counts one decoded block may hold (32 steps of 94 x 256 are 6 MB; a larger shape gets
# fewer steps per block, never less than one).
_BLOCK_BYTES = 64 << 20


class _Stored(tuple):
    """``(steps or step, layer_ids, counts)`` that also carries ``.widths``: callers that
    unpack three values keep working."""

    widths: np.ndarray

    def __new__(cls, first: Any, layer_ids: np.ndarray, counts: np.ndarray, widths: np.ndarray):
        self = super().__new__(cls, (first, layer_ids, counts))
        self.widths = widths
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (*self, self.widths)

    @property
    def layer_ids(self) -> np.ndarray:
        return self[1]

    @property
    def counts(self) -> np.ndarray:
        return self[2]


class StoredStep(_Stored):
    """One stored step: unpacks as ``(step, layer_ids, counts)``; ``.widths`` (int64 [L]) is
    each layer's number of experts (``E`` for every layer unless the layers differ, when
    ``counts[i, widths[i]:]`` are 0 and no expert)."""

    @property
    def step(self) -> int:
        return self[0]


class StoredBlock(_Stored):
    """Logged steps of one set of layers: unpacks as ``(steps [K], layer_ids [L], counts
    [K, L, E])``; ``.widths`` (int64 [L]) as for :class:`StoredStep`."""

    @property
    def steps(self) -> np.ndarray:
        return self[0]


def read_expert_loads(
    path: Path, steps: slice | None = None, *, skipped: list[str] | None = None
) -> Iterator[StoredStep]:
    """Yield ``(step, layer_ids int64 [L], counts int64 [L, E])`` in step order, one at a time
    (a :class:`StoredStep`: ``.widths`` says each layer's number of experts).

    ``steps`` picks step numbers ``start <= step < stop`` (either end open when None) without
    decoding the others; ``slice.step = k`` keeps every k-th logged step of that window. When a
    resumed run logged a step at or below one already stored, the earlier records from that
    step on are dropped (they belong to the timeline the restart abandoned), as for the JSONL.
    What is skipped (a torn tail, a damaged record, one failing its checksum, steps a restart
    superseded) is said in a warning each, or appended to ``skipped`` when it is given.
    """
    path = Path(path)
    _check_steps(steps)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; the expert-load store is written by runs with the JSONL sink "
            "on (logger.jsonl_enabled=true) and MoE metrics on (track_moe_metrics=true)"
        )
    say = _teller(path, skipped)
    with path.open("rb") as f:
        timeline = _index(f, steps, say, path)
        bad: list[int] = []
        for e in timeline:
            try:
                decoded = decode_record(f, e)
            except StoreCountError as err:
                say(str(err))
                continue
            if decoded is None:
                bad.append(e.step)
                continue
            ids, counts, widths = decoded
            yield StoredStep(e.step, ids, counts, _full(widths, e))
        _say_bad(say, bad)


def _check_steps(steps: slice | None) -> None:
    if steps is not None and not isinstance(steps, slice):
        raise TypeError(f"steps must be a slice of step numbers or None, got {steps!r}")
    if steps is not None and steps.step is not None and steps.step < 1:
        raise ValueError(f"steps.step must be >= 1 (keep every k-th logged step), got {steps.step}")


def _teller(path: Path, skipped: list[str] | None) -> Callable[[str], None]:
    def say(text: str) -> None:
        if skipped is not None:
            skipped.append(f"{path.name}: {text}")
        else:
            warnings.warn(f"{path}: {text}", stacklevel=4)

    return say


def _say_bad(say: Callable[[str], None], bad: list[int | str]) -> None:
    for text in [b for b in bad if isinstance(b, str)]:
        say(text)  # a count above the bound: named by step, layer and expert
    bad = [b for b in bad if not isinstance(b, str)]
    if bad:
        say(
            f"skipped {len(bad)} damaged record(s) (a payload failing its checksum, or not "
            f"inflating to the size its header declares): "
            f"step(s) {steps_text(bad)}"
        )


def steps_text(steps: list[int], limit: int = 12) -> str:
    """``3, 5, 9–14``: sorted steps, runs of consecutive ones joined."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    parts = [f"{r[0]}" if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs]
    return ", ".join(parts[:limit]) + (
        f", ... ({len(parts) - limit} more)" if len(parts) > limit else ""
    )


def _index(
    f: Any, steps: slice | None, say: Callable[[str], None], path: Path
) -> list[RecordHeader]:
    """The records of the run as it finally went, in step order, restricted to ``steps``;
    records above the limits are said and left out before anything is allocated for them."""
    scan = scan_store(f, name=path)
    if scan.torn_magic:
        say("the file is shorter than its 8-byte header (cut short before any record)")
    for gap in scan.gaps:
        say(gap.describe())
    timeline: list[RecordHeader] = []
    superseded: list[int] = []
    refused = [e for e in scan.entries if e.refusal]
    for e in refused[:3]:
        say(str(e.refusal))
    if len(refused) > 3:
        say(f"{len(refused) - 3} more record(s) above the limits skipped")
    for e in scan.entries:
        if e.refusal:
            continue
        while timeline and timeline[-1].step >= e.step:
            superseded.append(timeline.pop().step)
        timeline.append(e)
    if superseded:
        say(
            f"step(s) {steps_text(sorted(superseded))} stored again later (a restart from an "
            "earlier step): the later records are read"
        )
    newer = [e for e in timeline if e.newer]
    if newer:
        flags = sorted({f"0x{e.flags:04x}" for e in newer})
        say(
            f"step(s) {steps_text([e.step for e in newer])} written by a newer version of "
            f"nemo_moe_metrics (record flags {', '.join(flags)}): not read; upgrade "
            "nemo_moe_metrics to read them"
        )
        timeline = [e for e in timeline if not e.newer]
    if steps is not None:
        lo, hi = steps.start, steps.stop
        timeline = [
            e for e in timeline if (lo is None or e.step >= lo) and (hi is None or e.step < hi)
        ][:: steps.step or 1]
    return timeline


def read_expert_load_blocks(
    path: Path,
    steps: slice | None = None,
    *,
    block: int = 32,
    workers: int = 1,
    prepare: Callable[..., Any] | None = None,
    widths: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[Any]:
    """Like ``read_expert_loads``, but ``block`` logged steps at a time: yields ``(steps int64
    [K], layer_ids int64 [L], counts int64 [K, L, E])`` with ``K <= block``, in step order (a
    :class:`StoredBlock`, with ``.widths``); a block ends early where the layer ids, the
    layers' widths or the shape change. With ``workers > 1``, that many threads decode blocks
    ahead of the consumer (zlib and numpy release the GIL, so decoding overlaps the caller's
    work); at most ``2 * workers`` blocks are held at a time. ``prepare(steps, layer_ids,
    counts)``, when given, runs on each block in the decoding thread and its result is yielded
    instead; with ``widths=True`` it is called as ``prepare(steps, layer_ids, counts,
    widths)``. ``skipped`` as for ``read_expert_loads``.
    """
    path = Path(path)
    if block < 1 or workers < 1:
        raise ValueError(f"block and workers must be >= 1, got {block} and {workers}")
    _check_steps(steps)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (no expert-load store)")
    say = _teller(path, skipped)
    with path.open("rb") as f:
        timeline = _index(f, steps, say, path)
        # Blocks of records that share one shape (a change of shape starts a new block), each
        # holding at most _BLOCK_BYTES of counts, whatever the shape.
        groups: list[list[RecordHeader]] = []
        for e in timeline:
            g = groups[-1] if groups else None
            most = max(1, min(block, _BLOCK_BYTES // max(1, 8 * e.layers * e.experts)))
            if g and len(g) < most and (g[0].layers, g[0].experts) == (e.layers, e.experts):
                g.append(e)
            else:
                groups.append([e])
        fd = f.fileno()
        bad: list[int | str] = []
        if workers == 1:
            for g in groups:
                decoded, b = _decode_block(fd, g, prepare, widths)
                bad += b
                yield from decoded
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(workers, thread_name_prefix="nmm-store") as pool:
                pending = [
                    pool.submit(_decode_block, fd, g, prepare, widths)
                    for g in groups[: 2 * workers]
                ]
                nxt = len(pending)
                while pending:
                    decoded, b = pending.pop(0).result()
                    if nxt < len(groups):
                        pending.append(pool.submit(_decode_block, fd, groups[nxt], prepare, widths))
                        nxt += 1
                    bad += b
                    yield from decoded
        _say_bad(say, bad)


def _decode_block(
    fd: int,
    entries: list[RecordHeader],
    prepare: Callable[..., Any] | None = None,
    with_widths: bool = False,
) -> tuple[list[Any], list[int | str]]:
    """Decode records of one shape into ``[K, L, E]``; split where the layer ids or the
    layers' widths change."""
    e0 = entries[0]
    counts = np.empty((len(entries), e0.layers, e0.experts), dtype=np.int64)
    steps = np.empty(len(entries), dtype=np.int64)
    out: list[StoredBlock] = []
    ids: np.ndarray | None = None
    widths: np.ndarray | None = None
    start = k = 0
    bad: list[int | str] = []
    for e in entries:
        try:
            decoded = decode_record(fd, e, counts[k])
        except StoreCountError as err:
            bad.append(str(err))
            continue
        if decoded is None:
            bad.append(e.step)
            continue
        if ids is not None and (
            not np.array_equal(decoded[0], ids) or not _same_widths(decoded[2], widths)
        ):
            out.append(StoredBlock(steps[start:k], ids, counts[start:k], _full(widths, e0)))
            start = k
        ids, widths = decoded[0], decoded[2]
        steps[k] = e.step
        k += 1
    if ids is not None:
        out.append(StoredBlock(steps[start:k], ids, counts[start:k], _full(widths, e0)))
    if prepare is not None:
        if with_widths:
            return [prepare(*item, item.widths) for item in out], bad
        return [prepare(*item) for item in out], bad
    return out, bad


def _same_widths(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _full(widths: np.ndarray | None, e: RecordHeader) -> np.ndarray:
    return widths if widths is not None else np.full(e.layers, e.experts, np.int64)
