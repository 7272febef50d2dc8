"""The expert-load store: each logged step's [MoE layers x experts] token counts, appended.

``metrics.jsonl`` keeps scalars; the ``moe/expert_loads`` table goes here, about 57 KB per step
at 94 x 256 instead of 630 KB of JSON rows. This module is the store's public face: every name
users import from ``nemo_moe_metrics.sinks.store`` is here. The code lives in three modules:

- :mod:`~nemo_moe_metrics.sinks.store_format`: the file layout (record headers, encoding and
  decoding one step, crash safety), walking a file's headers (:func:`scan_store`);
- :mod:`~nemo_moe_metrics.sinks.store_writer`: :class:`ExpertLoadStore` (durable appends),
  :func:`cut_store_from` (resume), :class:`ExpertLoadSink`, the table-to-counts conversion;
- :mod:`~nemo_moe_metrics.sinks.store_reader`: :func:`read_expert_loads`,
  :func:`read_expert_load_blocks`, the timeline of a resumed run, what was skipped.
"""

from __future__ import annotations

from nemo_moe_metrics.sinks.store_format import (
    FILE_HEADER_SIZE,
    FORMAT_VERSION,
    PHASE_FILES,
    ROLLOUT_STORE_FILE,
    STORE_FILE,
    Gap,
    StoreError,
    StoreScan,
    scan_store,
    store_path,
)
from nemo_moe_metrics.sinks.store_reader import (
    StoredBlock,
    StoredStep,
    read_expert_load_blocks,
    read_expert_loads,
    steps_text,
)
from nemo_moe_metrics.sinks.store_writer import (
    ExpertLoadSink,
    ExpertLoadStore,
    cut_store_from,
    table_to_counts,
    table_to_counts_and_widths,
)

__all__ = [
    "FILE_HEADER_SIZE",
    "FORMAT_VERSION",
    "PHASE_FILES",
    "ROLLOUT_STORE_FILE",
    "STORE_FILE",
    "ExpertLoadSink",
    "ExpertLoadStore",
    "Gap",
    "StoreError",
    "StoreScan",
    "StoredBlock",
    "StoredStep",
    "cut_store_from",
    "read_expert_load_blocks",
    "read_expert_loads",
    "scan_store",
    "steps_text",
    "store_path",
    "table_to_counts",
    "table_to_counts_and_widths",
]
