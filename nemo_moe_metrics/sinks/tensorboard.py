"""TensorBoard sink: scalars only; tables never become one series per expert.

Each step's events are flushed and fsync'd before ``log`` returns, as the JSONL and the store
do: a step logged before a crash or a disk error stays in the event file.
"""

from __future__ import annotations

from pathlib import Path

from nemo_moe_metrics.runtime.durable import fsync_dir, fsync_path
from nemo_moe_metrics.runtime.extras import check_extra
from nemo_moe_metrics.sinks.base import Metrics, SinkBase, split_tables


class TensorBoardSink(SinkBase):
    """Write every scalar metric with ``add_scalar``; flush and fsync each step so a crash or a
    disk error loses nothing logged before it."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; events at or after it that an earlier
        process wrote are hidden, so a step is never shown twice."""
        check_extra("tensorboard", "the TensorBoard sink (logger.tensorboard_enabled)")
        # Imported here: torch.utils.tensorboard pulls in tensorboard, which is slow to import.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        self._writer.flush()
        fsync_dir(self.log_dir)  # the event file's name is on the device from the start
        fsync_dir(self.log_dir.parent)

    @property
    def path(self) -> Path:
        """The event file this writer appends to (the folder when it cannot be told)."""
        writer = getattr(self._writer, "file_writer", None)
        name = getattr(getattr(writer, "event_writer", None), "_file_name", None)
        return Path(name) if name else self.log_dir

    def wants_tables(self, step: int) -> bool:
        """Never: TensorBoard gets scalars only."""
        return False

    def location(self) -> str:
        """The event file (the folder when it cannot be told)."""
        return str(self.path)

    def log(self, metrics: Metrics, step: int) -> None:
        """Add one point per scalar key; skip tables (they live in the store and W&B)."""
        scalars, _ = split_tables(metrics)
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()
        if self.path != self.log_dir:
            fsync_path(self.path)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def logged_steps(log_dir: Path, limit: int = 1) -> list[int]:
    """Steps of the first ``limit`` scalar events in ``log_dir``'s event files, read without
    TensorBoard (TFRecord framing, then the event's top-level fields): a file that only holds
    its header (a run that died before its first step) gives none."""
    steps: list[int] = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pos = 0
        while pos + 12 <= len(data) and len(steps) < limit:
            length = int.from_bytes(data[pos : pos + 8], "little")
            event = data[pos + 12 : pos + 12 + length]
            if len(event) < length:
                break  # a record cut short
            fields = _top_level_fields(event)
            if 5 in fields:  # Event.summary
                steps.append(fields.get(2, 0))  # Event.step
            pos += 16 + length
    return steps


def _top_level_fields(message: bytes) -> dict[int, int]:
    """Field number -> value (varints) or 0 (other kinds) of a protobuf message's top level."""
    fields: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(message):
            key, pos = _varint(message, pos)
            number, kind = key >> 3, key & 7
            value = 0
            if kind == 0:
                value, pos = _varint(message, pos)
            elif kind == 1:
                pos += 8
            elif kind == 2:
                size, pos = _varint(message, pos)
                pos += size
            elif kind == 5:
                pos += 4
            else:
                break
            fields[number] = value
    except IndexError:
        pass
    return fields


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
