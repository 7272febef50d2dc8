"""Step timers of the :class:`~nemo_moe_metrics.throughput.StepMeter`: seconds per step from the
host clock (CPU, where work is done when a call returns) or from device events (CUDA: the host
waits once, at ``collect``, for the whole export).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class WallClockTimer:
    """Step seconds from the host clock: right on CPU, where work is done when calls return."""

    uses_events = False

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._start: float | None = None
        self._seconds: list[float] = []

    def start(self) -> None:
        self._start = self._clock()

    def stop(self) -> None:
        assert self._start is not None
        self._seconds.append(self._clock() - self._start)
        self._start = None

    def cancel(self) -> None:
        self._start = None

    def order_after_steps(self) -> None:
        """Nothing to order on the host clock."""

    def collect(self) -> list[float]:
        seconds, self._seconds = self._seconds, []
        return seconds


class EventTimer:
    """Step seconds from device events; the host waits once, at ``collect``.

    Events are recorded on the stream that runs the step and kept until export. At export the
    current stream is made to wait for every step's end event (device-side, no host wait), the
    caller queues its device-to-host copies, and one fence event recorded after them is
    synchronised: that single wait covers the timings and the copies.
    """

    uses_events = True

    def __init__(self, factory: Callable[[], Any], stream: Callable[[], Any]) -> None:
        self._factory = factory
        self._stream = stream
        self._open: Any = None
        self._pairs: list[tuple[Any, Any]] = []

    def start(self) -> None:
        event = self._factory()
        event.record(self._stream())
        self._open = event

    def stop(self) -> None:
        end = self._factory()
        end.record(self._stream())
        self._pairs.append((self._open, end))
        self._open = None

    def cancel(self) -> None:
        self._open = None

    def order_after_steps(self) -> None:
        stream = self._stream()
        for _, end in self._pairs:
            end.wait(stream)

    def collect(self) -> list[float]:
        pairs, self._pairs = self._pairs, []
        if not pairs:
            return []
        fence = self._factory()
        fence.record(self._stream())
        fence.synchronize()  # the one host-device synchronisation of an export
        return [start.elapsed_time(end) / 1000.0 for start, end in pairs]
