"""Pictures and a text summary of a run directory: its store, ``metrics.jsonl`` and ``run.json``.

``render_report(run_dir)`` writes these PNGs (into the run directory, or ``out_dir``) and
returns the summary:

- ``expert_load_heatmap.png``: MoE layers (rows) x experts (columns); colour is the expert's
  load as a multiple of the ideal (tokens x experts / layer tokens), on a log2 scale centred on
  1: white is balanced, red overloaded, blue underloaded, black an expert that got no token.
  Over a window of steps the tokens are summed first, so the picture is the window's load.
- ``expert_load_over_steps.png``: for the worst layers (or the ones asked for), step x expert
  of the same load / ideal, on the same colour scale; long runs are shown in step bins whose
  tokens are summed.
- ``routing_drift.png``: each layer's Jensen-Shannon divergence between consecutive logged
  steps (how much the router changed its mind).
- ``max_over_ideal.png``: each layer's worst-expert load over ideal, step by step.
- ``routing_disagreement.png``: each layer's ``moe/layer_{i}/routing_disagreement`` over steps
  (rollout vs training routes; runs with ``track_routing_consistency`` and per-layer logging);
  the summary names the worst layers.

The per-step expert counts come from the expert-load store (``expert_loads.bin``), read one
step at a time, or from ``moe/expert_loads`` rows in the JSONL of runs written before the store
existed. The JSONL is streamed for the few scalars the summary needs, so a 10,000-step run at
94 x 256 is read in seconds with a bounded amount of memory. Later records win when a resumed
run logged a step twice; a torn last line from a crash is skipped with a warning.

Layout: ``reading`` (the JSONL streamed, ``run.json``), ``expert_counts`` (a run's counts
step by step, from the store or the JSONL), ``timeline`` (counts over steps in bounded memory),
``pictures`` (matplotlib), ``bias`` and ``router_health_section`` (their sections of the
summary and pictures), ``summary`` (the text and which pictures to draw).
"""

from nemo_moe_metrics.report.pictures import (
    DRIFT_FILE,
    HEATMAP_FILE,
    MAX_OVER_IDEAL_FILE,
    OVER_STEPS_FILE,
    ROUTING_DISAGREEMENT_FILE,
)
from nemo_moe_metrics.report.reading import ReportError, Window, read_metrics
from nemo_moe_metrics.report.summary import (
    DEFAULT_DEAD_STEPS,
    DEFAULT_WORST_LAYERS,
    render_report,
    resolve_run_dir,
)

__all__ = [
    "DEFAULT_DEAD_STEPS",
    "DEFAULT_WORST_LAYERS",
    "DRIFT_FILE",
    "HEATMAP_FILE",
    "MAX_OVER_IDEAL_FILE",
    "OVER_STEPS_FILE",
    "ROUTING_DISAGREEMENT_FILE",
    "ReportError",
    "Window",
    "read_metrics",
    "render_report",
    "resolve_run_dir",
]
