"""The ``train_perf/`` metrics: step timing, and token and FLOP accounting.

- :mod:`.step_meter`: :class:`StepMeter` (tokens/s, FLOP/s, TFLOP/s per GPU, MFU);
- :mod:`.sequence_lengths`: real tokens per sequence and their sums on the device;
- :mod:`.step_timers`: seconds per step from the host clock or device events.

``from nemo_moe_metrics.throughput import StepMeter`` (also ``nemo_moe_metrics.StepMeter``).
"""

from __future__ import annotations

from nemo_moe_metrics.throughput.step_meter import (
    MAX_SEQUENCE_LENGTH,
    StepMeter,
    lengths_from_attention_mask,
    lengths_from_cu_seqlens,
    perf_metrics,
)

__all__ = [
    "MAX_SEQUENCE_LENGTH",
    "StepMeter",
    "lengths_from_attention_mask",
    "lengths_from_cu_seqlens",
    "perf_metrics",
]
