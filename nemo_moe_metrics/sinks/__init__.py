"""Metric sinks (JSONL, the expert-load store, TensorBoard, W&B, MLflow, trackio) behind one
small interface (:mod:`~nemo_moe_metrics.sinks.base`), built from a logger config
(:mod:`~nemo_moe_metrics.sinks.fanout`).

The local record is ``metrics.jsonl`` (scalars, every step) plus the expert-load store beside
it (``expert_loads.bin``: the ``moe/expert_loads`` counts every ``logger.table_every`` steps).
Each step goes to the JSONL last, so a step in ``metrics.jsonl`` is in every other sink too: a
run killed mid-step is continued from its last JSONL line. A write that fails for lack of
space or a disk error ends the run (:class:`SinkWriteError`).

Opening a run directory (its lock, one run per directory, resume, ``run.json``) belongs to
:mod:`nemo_moe_metrics.run_dir`; ``build_sinks`` and the resume names are re-exported here
for the code that imported them from this package, resolved on first use (that package
builds on this one).
"""

from __future__ import annotations

import importlib
from typing import Any

from nemo_moe_metrics.run_dir.names import METRICS_FILE, RUN_FILE, STORE_FILE, TENSORBOARD_DIR
from nemo_moe_metrics.sinks.base import (
    MultiSink,
    NullSink,
    Sink,
    SinkWriteError,
    split_tables,
    validate_metrics,
)
from nemo_moe_metrics.sinks.store import store_path

# name -> the run_dir module that defines it (imported on first use: it imports this package)
_RUN_DIR_EXPORTS = {
    "build_sinks": "nemo_moe_metrics.run_dir.session",
    "open_run": "nemo_moe_metrics.run_dir.session",
    "run_metadata": "nemo_moe_metrics.run_dir.run_json",
    "ResumeError": "nemo_moe_metrics.run_dir.resume",
    "ResumeState": "nemo_moe_metrics.run_dir.resume",
    "prepare_resume": "nemo_moe_metrics.run_dir.resume",
    "read_resume_state": "nemo_moe_metrics.run_dir.resume",
    "RunExistsError": "nemo_moe_metrics.run_dir.record",
    "clear_run": "nemo_moe_metrics.run_dir.record",
    "logged_run": "nemo_moe_metrics.run_dir.record",
    "RUN_RECORD": "nemo_moe_metrics.run_dir.names",
}


def __getattr__(name: str) -> Any:
    module = _RUN_DIR_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nemo_moe_metrics.sinks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "METRICS_FILE",
    "RUN_FILE",
    "STORE_FILE",
    "TENSORBOARD_DIR",
    "MultiSink",
    "NullSink",
    "Sink",
    "SinkWriteError",
    "split_tables",
    "store_path",
    "validate_metrics",
    *sorted(_RUN_DIR_EXPORTS),
]
