"""Reading a run directory: ``metrics.jsonl`` streamed, the expert-load store, ``run.json``.

The JSONL is scanned once for each line's step, byte offset and the few scalars the summary
needs; records are parsed only where a value is asked for. Later records win when a resumed run
logged a step twice; a torn last line from a crash is skipped with a warning.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import MAX_STEP
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.run_dir.names import METRICS_FILE as METRICS_FILE
from nemo_moe_metrics.run_dir.names import RUN_FILE as RUN_FILE
from nemo_moe_metrics.run_dir.run_json import TABLES_LOGGED
from nemo_moe_metrics.sinks.alerts import recorded_alerts

_LAYER_MOI = re.compile(r"^moe/layer_(\d+)/max_over_ideal$")
# Last values (throughput, aux losses) are looked for in this many final logged steps.
_LAST_LOOKBACK = 20

Window = tuple[int | None, int | None]


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says what is missing."""


# --- metrics.jsonl: streamed, only the numbers the summary needs --------------------------------

_STEP_PREFIX = b'{"step":'
_TABLE_KEY = ('"' + mn.EXPERT_LOADS + '":').encode()
_ALERTS_FIELD = b'"alerts":['  # the JSONL sink's alert records (sinks/jsonl.py)


def _number(line: bytes, key: str) -> float | None:
    """The scalar value of ``key`` in one compact JSONL line (as the JSONL sink writes it)."""
    token = ('"' + key + '":').encode()
    i = line.find(token)
    if i < 0:
        return None
    j = i + len(token)
    end = line.find(b",", j)
    raw = line[j : end if end >= 0 else len(line) - 1].strip()
    return None if raw == b"null" else float(raw)


@dataclass
class Line:
    step: int
    offset: int  # byte offset of the line in the file
    tokens: float | None
    seconds: float | None
    has_table: bool
    has_alerts: bool = False


class _Unreadable(ValueError):
    """A line that is no step record; the message says why, in a few words."""


def _parse_line(raw: bytes, offset: int) -> Line:
    """Step, tokens, seconds of one line; :class:`_Unreadable` (or ValueError, KeyError,
    TypeError) when it is torn or no step record."""
    line = raw.rstrip()
    if not (line.startswith(b"{") and line.endswith(b"}")):
        raise _Unreadable("not a whole JSON object (torn by a crash?)")
    try:
        line.decode("utf-8")  # later readers json.loads the line: it must be text
    except UnicodeDecodeError as err:
        raise _Unreadable(f"not UTF-8 text (byte {line[err.start]:#04x} at {err.start})") from None
    if line.startswith(_STEP_PREFIX):
        # The JSONL sink's layout: {"step":N,"key":value,...} with no spaces. Finding three
        # keys costs microseconds where json.loads of a 1,000-key line costs a millisecond.
        comma = line.find(b",")
        step = _step(line[len(_STEP_PREFIX) : comma if comma >= 0 else len(line) - 1])
        return Line(
            step,
            offset,
            _number(line, mn.TOKENS),
            _number(line, mn.SECONDS),
            _TABLE_KEY in line,
            _ALERTS_FIELD in line,
        )
    record = json.loads(line)  # written by something else: parse it properly
    return Line(
        _step(record["step"]),
        offset,
        record.get(mn.TOKENS),
        record.get(mn.SECONDS),
        mn.EXPERT_LOADS in record,
        "alerts" in record,
    )


def _step(value: Any) -> int:
    """A line's step: a whole number in 0..2**53-1 (a negative step would supersede every
    real one, as a restart from before the first step)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | bytes | str):
        raise _Unreadable(f"step {value!r} is not a whole number")
    try:
        step = int(value)
    except ValueError:
        shown = value.decode(errors="replace") if isinstance(value, bytes) else value
        raise _Unreadable(f"step {shown!r} is not a number") from None
    if not 0 <= step <= MAX_STEP:
        raise _Unreadable(f"step {step} is outside 0..2**53-1, so no step a run logs")
    return step


def _drop_restarted(records: list[Any], step: int) -> list[int]:
    # A step that goes back means the run restarted from a checkpoint: the records logged at
    # or after that step before the restart belong to an abandoned timeline.
    dropped = []
    while records and records[-1].step >= step:
        dropped.append(records.pop().step)
    return dropped


def _in_window(step: int, window: Window | None) -> bool:
    return window is None or (
        (window[0] is None or step >= window[0]) and (window[1] is None or step <= window[1])
    )


def window_text(window: Window) -> str:
    return f"{'' if window[0] is None else window[0]}:{'' if window[1] is None else window[1]}"


def scan_jsonl(
    path: Path, window: Window | None, skipped: list[str] | None = None
) -> tuple[list[Line], tuple[int, int] | None]:
    """The logged steps of the run as it finally went, restricted to the window, and the
    first/last step of the whole log. What was passed over (unreadable lines, steps that a
    later line logged again) is said in ``skipped`` when given, else in a warning."""
    lines: list[Line] = []
    torn: list[int] = []
    why: list[str] = []
    offset = 0
    said: list[str] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                line = _parse_line(raw, start)
            except (ValueError, KeyError, TypeError) as err:
                torn.append(number)  # a line cut short by a crash; the completed ones are good
                if isinstance(err, _Unreadable) and len(why) < 3:
                    why.append(f"line {number}: {err}")
                continue
            dropped = _drop_restarted(lines, line.step)
            if dropped:
                said.append(
                    f"{path.name}: steps {_span(sorted(dropped))} ({len(dropped)} logged) "
                    f"superseded: line {number} logs step {line.step} again (a restart from an "
                    "earlier step, or a second writer); the later records are read"
                )
            lines.append(line)
    if torn:
        shown = ", ".join(map(str, torn[:5])) + (", ..." if len(torn) > 5 else "")
        reasons = "; ".join(why) if why else f"line {shown}: torn by a crash?"
        said.insert(0, f"{path.name}: skipped {len(torn)} unreadable line(s) ({reasons})")
    for text in said:
        if skipped is not None:
            skipped.append(text)
        else:
            warnings.warn(f"{path.parent}: {text}", stacklevel=3)
    seen = (lines[0].step, lines[-1].step) if lines else None
    return [ln for ln in lines if _in_window(ln.step, window)], seen


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every step record of a JSONL file, parsed, in step order, as the run finally went.

    When a resumed run logs a step at or below one already in the file, the earlier records
    from that step on are dropped (they belong to the timeline abandoned by the restart).
    A torn line (crash mid-write) is skipped with one warning.
    """
    path = Path(path)
    lines, _ = scan_jsonl(path, None)
    with path.open("rb") as f:
        return [read_line(f, line) for line in lines]


def read_line(f: Any, line: Line) -> dict[str, Any]:
    f.seek(line.offset)
    return json.loads(f.readline())


def last_values(path: Path, lines: list[Line], keys: list[str]) -> dict[str, float]:
    """Each key's last non-null value among the final logged steps of the window."""
    out: dict[str, float] = {}
    with path.open("rb") as f:
        for line in reversed(lines[-_LAST_LOOKBACK:]):
            f.seek(line.offset)
            raw = f.readline().rstrip()
            for key in keys:
                if key in out:
                    continue
                if raw.startswith(_STEP_PREFIX):
                    value = _number(raw, key)
                else:
                    value = json.loads(raw).get(key)
                if value is not None:
                    out[key] = float(value)
            if len(out) == len(keys):
                break
    return out


def alert_records(path: Path, lines: list[Line]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(step, alert records)`` of the lines that recorded alerts (the JSONL's ``"alerts"``)."""
    out = []
    with path.open("rb") as f:
        for line in lines:
            if line.has_alerts:
                out.append((line.step, recorded_alerts(read_line(f, line))))
    return out


def layer_key_series(
    path: Path, lines: list[Line], pattern: re.Pattern[str] | None = None
) -> tuple[list[int], dict[int, list[float]]]:
    """Per-layer max/ideal from ``moe/layer_{i}/max_over_ideal`` keys (runs without counts);
    ``pattern`` (group 1: the layer) reads another per-layer key instead."""
    pattern = pattern or _LAYER_MOI
    steps: list[int] = []
    series: dict[int, list[float]] = {}
    with path.open("rb") as f:
        for line in lines:
            values = {
                int(m.group(1)): float(v)
                for k, v in read_line(f, line).items()
                if (m := pattern.match(k)) and v is not None
            }
            if not values:
                continue
            steps.append(line.step)
            for layer, v in values.items():
                series.setdefault(layer, [math.nan] * (len(steps) - 1)).append(v)
            for vs in series.values():
                if len(vs) < len(steps):
                    vs.append(math.nan)
    return steps, dict(sorted(series.items()))


def key_series(path: Path, lines: list[Line], keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Each key's value on every line of ``lines`` (NaN where a line lacks it), in one pass
    that parses only the lines written by something other than the JSONL sink."""
    out = {key: np.full(len(lines), np.nan) for key in keys}
    with path.open("rb") as f:
        for i, line in enumerate(lines):
            f.seek(line.offset)
            raw = f.readline().rstrip()
            record = None if raw.startswith(_STEP_PREFIX) else json.loads(raw)
            for key in keys:
                try:
                    value = _number(raw, key) if record is None else record.get(key)
                except ValueError:  # not a number (a list, a string): no value of this series
                    value = None
                if isinstance(value, int | float):
                    out[key][i] = value
    return out


def layer_stat_series(path: Path, lines: list[Line], stat: str) -> dict[int, np.ndarray]:
    """``moe/layer_{i}/{stat}`` of every layer on every line of ``lines`` (NaN where a line
    lacks it); only the layers that log it. The sink's compact lines are searched, not parsed."""
    needle = b"/" + stat.encode() + b'":'  # a cheap look before the regular expression
    token = re.compile(rb'"moe/layer_(\d+)/' + re.escape(stat.encode()) + rb'":([^,}]+)')
    pattern = re.compile(r"^moe/layer_(\d+)/" + re.escape(stat) + "$")
    found: dict[int, np.ndarray] = {}
    with path.open("rb") as f:
        for i, line in enumerate(lines):
            f.seek(line.offset)
            raw = f.readline().rstrip()
            if raw.startswith(_STEP_PREFIX):
                if needle not in raw:
                    continue
                pairs = [(int(m[1]), m[2]) for m in token.finditer(raw)]
            else:
                pairs = [
                    (int(m[1]), v)
                    for k, v in json.loads(raw).items()
                    if (m := pattern.match(k)) and isinstance(v, int | float)
                ]
            for layer, value in pairs:
                try:
                    number = float(value)
                except ValueError:  # null
                    continue
                found.setdefault(layer, np.full(len(lines), np.nan))[i] = number
    return dict(sorted(found.items()))


# --- pictures ----------------------------------------------------------------------------------


# What to set for a missing family: (recipe key, Python API field), by hint name.
FLAG_HINTS: dict[str, tuple[str, str]] = {
    "table": (
        "policy.megatron_cfg.track_moe_metrics=true and log_expert_table=true",
        "MetricsConfig(track_moe_metrics=True, log_expert_table=True)",
    ),
    "per_layer": (
        "policy.megatron_cfg.moe_per_layer_logging=true or log_expert_table=true",
        "MetricsConfig(moe_per_layer_logging=True) or log_expert_table=True",
    ),
    "moe": ("policy.megatron_cfg.track_moe_metrics=true", "MetricsConfig(track_moe_metrics=True)"),
    "throughput": (
        "policy.megatron_cfg.track_throughput=true",
        "MetricsConfig(track_throughput=True)",
    ),
    "flops": ("policy.megatron_cfg.track_flops=true", "MetricsConfig(track_flops=True)"),
    "peak": (
        "set policy.megatron_cfg.peak_flops_per_gpu",
        "pass MetricsConfig(peak_flops_per_gpu=...)",
    ),
    "table_every": ("logger.table_every", "LoggerConfig(table_every=...)"),
}


@dataclass
class RunInfo:
    """What ``run.json`` adds to the pictures' titles (all optional)."""

    name: str
    num_experts: int | None = None
    topk: int | None = None
    #: written by a recipe (``nemo-moe-metrics run``, ``train``): hints name recipe keys;
    #: False for a run logged through the Python API (hints name MetricsConfig fields)
    recipe: bool = True
    #: the recipe's ``logger.table_every`` (None when run.json does not say)
    table_every: int | None = None
    #: run.json says the run logged expert-load tables (``expert_tables``)
    tables_logged: bool = False

    def hint(self, key: str) -> str:
        """How to turn on what ``key`` names, in the terms of whoever wrote the run."""
        recipe, api = FLAG_HINTS[key]
        return recipe if self.recipe else api

    def model_label(self, n_layers: int, n_experts: int | Sequence[int] | np.ndarray) -> str:
        """``name: 94 MoE layers × 256 experts, top-8``; ``n_experts`` may be each layer's
        count, and layers that differ read ``× 4–8 experts``."""
        topk = f", top-{self.topk}" if self.topk else ""
        return f"{self.name}: {n_layers} MoE layers × {experts_text(n_experts)} experts{topk}"


def no_counts_text(run: RunInfo, stored: bool, span: str, skipped: str) -> str:
    """Why a run has no expert counts, as it happened: tables were logged but the store
    (``stored``: its file exists) holds no step yet (the cadence was not reached and the run
    did not close), or no table at all (the flags were off). ``span``: the logged steps;
    ``skipped``: what was skipped."""
    if stored and run.tables_logged:
        every = f"every {run.table_every} steps" if run.table_every else "on its cadence"
        return (
            f"no stored expert-load step yet: the store keeps the table {every} "
            f"({run.hint('table_every')}) and the last step's when the run closes; this run "
            f"logged {span} and did not close (still running, or killed): {skipped}. Report "
            "it again once it ends, or store the table more often"
        )
    return (
        "no expert-load counts in the run (no expert_loads.bin, no moe/expert_loads rows): "
        f"{skipped}; log them with " + run.hint("table")
    )


def experts_text(n_experts: int | Sequence[int] | np.ndarray) -> str:
    """``8`` for one expert count, ``4–8`` for layers whose counts differ."""
    counts = np.atleast_1d(np.asarray(n_experts, dtype=np.int64))
    if not counts.size:
        return "0"
    lo, hi = int(counts.min()), int(counts.max())
    return str(hi) if lo == hi else f"{lo}–{hi}"


def run_info(run_dir: Path) -> RunInfo:
    meta: dict[str, Any] = {}
    if (run_dir / RUN_FILE).is_file():
        try:
            meta = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
        except ValueError as err:
            # Metadata only adds the run name and expert count; the JSONL alone is enough.
            warnings.warn(
                f"{run_dir / RUN_FILE} is not valid JSON ({err}); ignoring it", stacklevel=3
            )
    if not isinstance(meta, dict) or not isinstance(meta.get("config") or {}, dict):
        warnings.warn(
            f"{run_dir / RUN_FILE} is not a run record (a JSON object with run_name, config, "
            "...; found "
            + (f"config as {type(meta['config']).__name__}" if isinstance(meta, dict) else "")
            + (type(meta).__name__ if not isinstance(meta, dict) else "")
            + "); ignoring it",
            stacklevel=3,
        )
        meta = {}
    return RunInfo(
        name=str(meta.get("run_name") or run_dir.resolve().name),
        num_experts=_positive_int(meta.get("num_experts")),
        topk=_positive_int(meta.get("moe_router_topk")),
        # A recipe's config is the whole Recipe dump; the API passes what it likes (or nothing).
        recipe=not meta or "algorithm" in (meta.get("config") or {}),
        table_every=_table_every(meta),
        tables_logged=meta.get(TABLES_LOGGED) is True,
    )


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _table_every(meta: dict[str, Any]) -> int | None:
    logger = (meta.get("config") or {}).get("logger") or {}
    every = logger.get("table_every") if isinstance(logger, dict) else None
    return every if isinstance(every, int) and every >= 1 else None
