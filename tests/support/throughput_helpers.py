"""Test doubles for the step meter: a scripted host clock, a CUDA-event stand-in, a toy FLOP
count."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

# Toy model for FLOP expectations: P parameters, attention width D.
TOY_PARAMS = 1000
TOY_ATTN = 8


def toy_flops(seq_lens, causal: bool = True) -> SimpleNamespace:
    """6 * P per token plus 12 * D per attended (query, key) pair; causal counts L(L+1)/2 pairs."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    pairs = lens * (lens + 1) // 2 if causal else lens * lens
    return SimpleNamespace(total=float(6 * TOY_PARAMS * lens.sum() + 12 * TOY_ATTN * pairs.sum()))


class FakeClock:
    """A host clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeStream:
    """One device stream: a device clock in ms, the order of recorded events, a sync counter."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.recorded = 0
        self.completed = 0  # events with seq <= completed are done
        self.synchronizations = 0
        self.waits = 0

    def run(self, ms: float) -> None:
        """Device work that takes ``ms`` milliseconds, queued asynchronously."""
        self.now_ms += ms

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """Behaves like ``torch.cuda.Event(enable_timing=True)`` on one stream.

    Like CUDA, ``elapsed_time`` fails unless both events have completed, and an event completes
    only when the host synchronises on it or on a later event of the same stream.
    """

    def __init__(self, stream: FakeStream) -> None:
        self._stream = stream
        self.seq: int | None = None
        self.time_ms: float | None = None

    def record(self, stream=None) -> None:
        self._stream.recorded += 1
        self.seq = self._stream.recorded
        self.time_ms = self._stream.now_ms

    def wait(self, stream=None) -> None:
        self._stream.waits += 1  # one stream: ordering is already given

    def synchronize(self) -> None:
        assert self.seq is not None, "synchronize() on an event never recorded"
        self._stream.synchronizations += 1
        self._stream.completed = max(self._stream.completed, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        for ev in (self, end):
            if ev.seq is None or ev.seq > self._stream.completed:
                raise RuntimeError("elapsed_time on an event that has not completed")
        return end.time_ms - self.time_ms
