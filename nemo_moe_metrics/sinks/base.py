"""The sink interface, a do-nothing sink, a fan-out sink and the metric-value checks.

A sink takes one step's metrics as plain Python values: numbers, and tables under the keys of
``metric_names.TABLE_COLUMNS``: an :class:`~nemo_moe_metrics.export.expert_table.ExpertTable` (what
the metrics make: arrays checked when it was built, a rows view for sinks that want rows) or a list
of rows (a table built by hand, checked row by row here). A sink may define ``wants_tables(step)``:
when no sink of a ``MultiSink`` wants tables at a step (off the ``logger.table_every``
cadence), the tables are dropped before they are checked. Tensors are refused on purpose: converting
one here would hide a host-device synchronisation per key; the worker converts everything in
its single synchronisation at the end of the step.
"""

from __future__ import annotations

import errno
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from nemo_moe_metrics.export.expert_table import ExpertTable
from nemo_moe_metrics.export.metric_names import TABLE_COLUMNS

MetricValue = float | int | list | ExpertTable
Metrics = Mapping[str, MetricValue]


@runtime_checkable
class Sink(Protocol):
    """Where one step's metrics go: ``log`` once per step, ``close`` once at the end."""

    def log(self, metrics: Metrics, step: int) -> None:
        """Record ``metrics`` for training step ``step``."""
        ...

    def close(self) -> None:
        """Flush and release files and services; later ``log`` calls are errors."""
        ...


class SinkBase:
    """The optional capabilities a sink declares, with their defaults; every sink of this
    package subclasses it. A plain object with ``log`` and ``close`` is a sink too: the fan-out
    gives it these defaults (every table, no alert records, its type name in messages)."""

    #: the fan-out passes the step's alert records to ``log`` as a third argument
    records_alerts: ClassVar[bool] = False

    def wants_tables(self, step: int) -> bool:
        """Whether this sink takes the step's tables (off its cadence they are not even
        checked when no sink takes them)."""
        return True

    def location(self) -> str:
        """The file or folder this sink writes, for messages (its type name when none)."""
        return type(self).__name__


class _PlainSink(SinkBase):
    """The declared defaults for a sink that is not a :class:`SinkBase`."""

    def __init__(self, sink: Sink) -> None:
        self._name = type(sink).__name__

    def location(self) -> str:
        return self._name


def capabilities(sink: Sink) -> SinkBase:
    """What ``sink`` declares: itself when it is a :class:`SinkBase`, else the defaults."""
    return sink if isinstance(sink, SinkBase) else _PlainSink(sink)


class NullSink(SinkBase):
    """A sink that drops everything: used on ranks other than 0 and when logging is off."""

    def wants_tables(self, step: int) -> bool:
        """Never."""
        return False

    def log(self, metrics: Metrics, step: int) -> None:
        """Drop ``metrics``."""

    def close(self) -> None:
        """Nothing to release."""


def is_table(key: str) -> bool:
    """Whether ``key`` names a table (a list of rows) rather than a scalar."""
    return key in TABLE_COLUMNS


def split_tables(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(scalars, tables)``: split one step's metrics for a logger that takes numbers only.

    ``tables`` holds the table-valued keys (``moe/expert_loads``: a list of rows, columns in
    ``TABLE_COLUMNS``); ``scalars`` holds everything else, unchanged. Give ``scalars`` to e.g.
    megatron's ``training_log`` or NeMo RL's logger, and ``tables`` to a sink that keeps tables.
    """
    scalars: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for key, value in metrics.items():
        (tables if is_table(key) else scalars)[key] = value
    return scalars, tables


def validate_metrics(metrics: Metrics, step: int) -> dict[str, MetricValue]:
    """Check one step's metrics and return them as plain Python values.

    Numbers become ``float``/``int``; an :class:`ExpertTable` passes as it is (checked as
    arrays when it was built: no row is made or checked here); a list of rows becomes a list
    of row lists whose length matches its columns. Anything else raises ``TypeError``/``ValueError``
    naming the key and the fix.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of key -> value, got {type(metrics).__name__}")
    clean: dict[str, MetricValue] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric keys must be non-empty strings, got {key!r}")
        if key == "step":
            raise ValueError("'step' is reserved (it is the record's step); rename the metric")
        table = is_table(key)
        if type(value) is float and not table:  # the usual value: no ABC check (~µs a key)
            clean[key] = value
        elif table:
            clean[key] = value if isinstance(value, ExpertTable) else _validate_table(key, value)
        elif isinstance(value, numbers.Integral):  # bool included: True -> 1
            clean[key] = int(value)
        elif isinstance(value, numbers.Real):
            clean[key] = float(value)
        elif type(value).__module__.startswith("torch"):
            raise TypeError(
                f"metric {key!r} is a torch.Tensor; sinks take Python numbers. Convert all "
                "metrics in the step's one synchronisation (e.g. torch.stack(...).tolist()), "
                "not one .item() per key"
            )
        elif isinstance(value, list | tuple):
            raise TypeError(
                f"metric {key!r} is a list but not a known table; tables are "
                f"{sorted(TABLE_COLUMNS)}. Add the key and its columns to "
                "metric_names.TABLE_COLUMNS, or log one scalar per key"
            )
        else:
            raise TypeError(
                f"metric {key!r} has type {type(value).__name__}; sinks take int, float or a "
                "table (list of rows)"
            )
    return clean


def _validate_table(key: str, value: object) -> list[list]:
    columns = TABLE_COLUMNS[key]
    if not isinstance(value, list | tuple):
        raise TypeError(
            f"table {key!r} must be a list of rows {list(columns)}, got {type(value).__name__}"
        )
    width = len(columns)
    # Fast path: plain int/float cells (what the worker produces) in one pass; 16,384 rows of a
    # 64 x 256 table take a few milliseconds. Anything else goes through the precise checks.
    try:
        if all(
            len(row) == width
            and all(type(c) is int or (type(c) is float and math.isfinite(c)) for c in row)
            for row in value
        ):
            return [list(row) for row in value]
    except TypeError:
        pass
    rows: list[list] = []
    for n, row in enumerate(value):
        if not isinstance(row, Sequence) or isinstance(row, str) or len(row) != width:
            raise ValueError(
                f"table {key!r} row {n} is {row!r}; each row must be a list of "
                f"{width} values {list(columns)}"
            )
        out = []
        for col, cell in zip(columns, row, strict=True):
            if isinstance(cell, bool) or not isinstance(cell, numbers.Real):
                raise TypeError(
                    f"table {key!r} row {n} column {col!r} is {cell!r}; cells must be numbers"
                )
            if isinstance(cell, numbers.Integral):
                out.append(int(cell))
            elif math.isfinite(cell):
                out.append(float(cell))
            else:
                raise ValueError(
                    f"table {key!r} row {n} column {col!r} is {cell}; table cells must be finite "
                    "(an empty layer has tokens 0 and load_percent 0, not NaN)"
                )
        rows.append(out)
    return rows


def finite_or_none(value: float | int) -> float | int | None:
    """``value`` itself, or ``None`` for NaN/inf (strict JSON has no NaN; readers see null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _wants_tables(sink: SinkBase, step: int) -> bool:
    try:
        return bool(sink.wants_tables(step))
    except Exception:  # a sink's bug must not cost the others their table
        return True


#: Write errors that end the run: the disk (or quota) is full, or it fails. Every later write
#: would fail too, and logging on regardless would only lose steps silently.
FATAL_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


class SinkWriteError(OSError):
    """A sink could not write its file (disk full, disk error): the run stops with this."""

    def __str__(self) -> str:
        return str(self.strerror)


def _failed_file(err: OSError, sink: SinkBase) -> str:
    """The file that could not be written: a copy's destination (``filename2``, e.g. W&B
    copying a temporary file into the run directory) when it is the sink's, else ``filename``."""
    own = sink.location()
    target = getattr(err, "filename2", None)
    if target and os.path.abspath(str(target)).startswith(os.path.abspath(own).rstrip("/")):
        return str(target)
    return str(err.filename or own)


def _fatal_write_error(sink: SinkBase, err: OSError, last_step: int | None) -> SinkWriteError:
    name = errno.errorcode.get(err.errno or 0, str(err.errno))
    what = err.strerror or str(err)
    saved = (
        f"steps up to {last_step} are saved and stay readable"
        if last_step is not None
        else "no step was saved yet"
    )
    return SinkWriteError(
        err.errno,
        f"cannot write {_failed_file(err, sink)}: {what} ({name}); the run stops here "
        f"and {saved}. Free space or fix the disk (or move the run directory to another "
        "disk), then continue the run with --resume (logger.resume=true)",
    )


class StepMonitor(Protocol):
    """Looks at each step before the sinks do; returns extra metrics to log with it.

    ``last_alerts``: the observed step's alerts (objects with ``record()``), which the fan-out
    hands to the sinks that record them (``records_alerts = True``: the JSONL sink, see
    :mod:`nemo_moe_metrics.sinks.alerts`).
    """

    last_alerts: Sequence[Any]

    def observe(self, metrics: Mapping[str, MetricValue], step: int) -> Mapping[str, int | float]:
        """Judge one step (e.g. print alerts); the returned keys are added to the step."""
        ...


class MultiSink(SinkBase):
    """Fan one step out to several sinks; a failing sink warns once and never stops the others,
    except when it cannot write for lack of space or a disk error (:data:`FATAL_WRITE_ERRNOS`):
    then the other sinks are closed (flushing what they hold) and :class:`SinkWriteError`,
    naming the file, ends the run.

    An optional ``monitor`` (the alert monitor of ``logger.alerts``) sees each validated step
    first; the metrics it returns (``moe/alerts``) are logged with the step by every sink.
    """

    def __init__(self, sinks: Sequence[Sink], *, monitor: StepMonitor | None = None) -> None:
        self.sinks = list(sinks)
        self.monitor = monitor
        self._warned: set[int] = set()
        self._closed = False
        self._last_step: int | None = None

    def log(self, metrics: Metrics, step: int) -> None:
        """Let the monitor add its keys, validate once, then hand the step to every sink.

        The monitor sees every step's tables; off the table cadence (no sink's
        ``wants_tables(step)`` is true) they are then dropped before validation (a table
        built by hand as a list of rows is checked row by row: about 9 ms at 94 x 256; an
        :class:`ExpertTable` was checked as arrays when it was made).
        """
        if self._closed:
            raise RuntimeError("log() after close(); build a new sink for a new run")
        alerts: list[dict[str, Any]] = []
        if self.monitor is not None and isinstance(metrics, Mapping):
            extra = self._guarded(self.monitor, "observe", metrics, step)
            if extra:
                metrics = {**metrics, **extra}
                alerts = [a.record() for a in self.monitor.last_alerts]
        if (
            isinstance(metrics, Mapping)
            and any(is_table(k) for k in metrics)
            and not any(_wants_tables(capabilities(sink), step) for sink in self.sinks)
        ):
            metrics = {k: v for k, v in metrics.items() if not is_table(k)}
        clean = validate_metrics(metrics, step)
        for sink in self.sinks:
            if alerts and capabilities(sink).records_alerts:
                self._guarded(sink, "log", clean, int(step), alerts)
            else:
                self._guarded(sink, "log", clean, int(step))
        self._last_step = int(step)

    def close(self) -> None:
        """Close every sink (each guarded the same way); closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            self._guarded(sink, "close")

    def _guarded(self, sink: object, method: str, *args: object) -> object:
        try:
            return getattr(sink, method)(*args)
        except OSError as err:
            if err.errno in FATAL_WRITE_ERRNOS and not self._closed:
                fatal = _fatal_write_error(capabilities(sink), err, self._last_step)
                self.close()  # flush what the others hold; failures while closing only warn
                raise fatal from err
            self._warn_once(sink, method, err)
        except Exception as err:  # one sink's failure must not cost the others their data
            self._warn_once(sink, method, err)
        return None

    def _warn_once(self, sink: object, method: str, err: Exception) -> None:
        if id(sink) in self._warned:
            return
        self._warned.add(id(sink))
        warnings.warn(
            f"{type(sink).__name__}.{method} failed ({type(err).__name__}: {err}); the "
            "other sinks keep logging. Further failures of this sink are not reported.",
            RuntimeWarning,
            stacklevel=4,
        )
