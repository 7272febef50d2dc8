"""Step timers (throughput/step_timers.py): on the event path (CUDA events stood in for) the
export waits once, a failed step is not counted, an export without steps does not wait."""

from __future__ import annotations

import pytest
from throughput_helpers import FakeStream, toy_flops

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.throughput import (
    StepMeter,
)
from tests.throughput.test_step_meter import lens_tensor

# --- the event path (CUDA events stood in for by FakeEvent) ------------------------------------


def test_event_path_synchronises_once_per_export():
    stream = FakeStream()
    meter = StepMeter(event_factory=stream.event, flops_estimator=toy_flops)
    assert meter.uses_events
    for ms in (40.0, 60.0, 100.0):
        with meter.step():
            for _ in range(4):
                meter.add_sequences(lens_tensor(8, 8))
                stream.run(ms / 4)
        stream.run(1000.0)  # between steps: not step time
    assert stream.synchronizations == 0  # nothing waited per microbatch or per step
    out = meter.export()
    assert stream.synchronizations == 1
    assert out[mn.SECONDS] == pytest.approx(0.2)
    assert out[mn.TOKENS] == 3 * 4 * 16
    with meter.step():
        meter.add_sequences(lens_tensor(1))
        stream.run(10.0)
    assert meter.export()[mn.SECONDS] == pytest.approx(0.01)
    assert stream.synchronizations == 2


def test_event_path_failed_step_is_not_counted():
    stream = FakeStream()
    meter = StepMeter(event_factory=stream.event)
    with pytest.raises(KeyError), meter.step():
        meter.add_sequences(lens_tensor(50))
        stream.run(500.0)
        raise KeyError("boom")
    with meter.step():
        meter.add_sequences(lens_tensor(5))
        stream.run(20.0)
    out = meter.export()
    assert (out[mn.TOKENS], out[mn.SECONDS]) == (5.0, pytest.approx(0.02))


def test_event_path_export_without_steps_does_not_synchronise():
    stream = FakeStream()
    meter = StepMeter(event_factory=stream.event)
    assert meter.export()[mn.SECONDS] == 0.0
    assert stream.synchronizations == 0
