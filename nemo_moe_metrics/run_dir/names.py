"""Every name a run writes into its run directory, in one place.

A run directory (``<--output-dir>/<recipe name>/``) holds only these entries: the sinks' records
(:data:`RUN_RECORD`: ``metrics.jsonl``, the expert-load store, ``run.json``, TensorBoard, W&B,
MLflow, trackio, the pictures ``report`` draws and its page ``report.html``), what the launcher
writes (:data:`LAUNCH_FILES`: ``recipe.yaml``, ``launch.log``, nemo-run's state) and the lock
(``.run.lock``, which also marks the directory as a run's, even one that failed before it logged a
step). Deleting a run deletes these names and nothing else; a directory that holds anything else is
not a run's (:mod:`nemo_moe_metrics.run_dir`). The directory's own name is checked where the recipe
is read (:mod:`nemo_moe_metrics.config.run_name`).
"""

from __future__ import annotations

import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
STORE_FILE = "expert_loads.bin"
ROLLOUT_STORE_FILE = "rollout_expert_loads.bin"
RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlflow_artifacts"
TRACKIO_DIR = "trackio"
LOCK_FILE = ".run.lock"
LAUNCH_LOG = "launch.log"
NEMORUN_DIR = "nemo_run"

# The pictures ``nemo-moe-metrics report`` draws into the run directory.
HEATMAP_FILE = "expert_load_heatmap.png"
OVER_STEPS_FILE = "expert_load_over_steps.png"
DRIFT_FILE = "routing_drift.png"
MAX_OVER_IDEAL_FILE = "max_over_ideal.png"
ROUTING_DISAGREEMENT_FILE = "routing_disagreement.png"
ROUTER_HEALTH_FILE = "router_health.png"
BIAS_FILE = "expert_bias.png"
SWEEP_FILE = "placement_sweep.png"
ROLLOUT_VS_TRAIN_FILE = "rollout_vs_train_load.png"
PICTURES = (
    HEATMAP_FILE,
    OVER_STEPS_FILE,
    DRIFT_FILE,
    MAX_OVER_IDEAL_FILE,
    ROUTING_DISAGREEMENT_FILE,
    ROUTER_HEALTH_FILE,
    BIAS_FILE,
    SWEEP_FILE,
    ROLLOUT_VS_TRAIN_FILE,
)
#: The page ``nemo-moe-metrics report --html`` writes beside the pictures.
REPORT_PAGE_FILE = "report.html"

#: What the sinks and ``report`` write: ``build_sinks(..., overwrite=True)`` deletes these.
RUN_RECORD = (
    METRICS_FILE,
    STORE_FILE,
    ROLLOUT_STORE_FILE,
    RUN_FILE,
    TENSORBOARD_DIR,
    WANDB_DIR,
    MLFLOW_DB,
    MLFLOW_ARTIFACTS_DIR,
    TRACKIO_DIR,
    *PICTURES,
    REPORT_PAGE_FILE,
)
#: What a launcher (``nemo-moe-metrics run``, the per-rank entrypoint) writes beside the record.
LAUNCH_FILES = (RECIPE_FILE, LAUNCH_LOG, NEMORUN_DIR)
#: Every entry of a run directory.
RUN_FILES = (*RUN_RECORD, *LAUNCH_FILES, LOCK_FILE)
# SQLite's companions of mlflow.db while it is open or after a crash.
_SQLITE_SUFFIXES = ("-journal", "-wal", "-shm")


def is_run_file(name: str) -> bool:
    """Whether ``name`` (an entry of a run directory) is one a run writes: a name of
    :data:`RUN_FILES`, SQLite's files beside ``mlflow.db``, or the temporary file of an atomic
    write (``run.json…tmp``, ``.expert_load_heatmap.….tmp.png``) that a crash left behind."""
    if name in RUN_FILES:
        return True
    if any(name == MLFLOW_DB + suffix for suffix in _SQLITE_SUFFIXES):
        return True
    bare = name.lstrip(".")
    return ".tmp" in bare and any(bare.startswith(_stem(f)) for f in RUN_RECORD + (RECIPE_FILE,))


def linked_run_files(run_dir: Path) -> list[str]:
    """The run's own entries of ``run_dir`` that are symbolic links (a run never writes or
    deletes through one), each as ``path -> target``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [
        f"{run_dir / name} -> {os.readlink(run_dir / name)}"
        for name in sorted(os.listdir(run_dir))
        if is_run_file(name) and (run_dir / name).is_symlink()
    ]


def links_refusal(links: list[str], elsewhere: str) -> str:
    """The message refusing a run directory whose own files are the symbolic ``links``."""
    return (
        f"{', '.join(links)}: a run's own files must not be symbolic links (a run writes and "
        "deletes only inside its directory, never through a link); remove the link(s) (rm "
        f"leaves the target alone), or {elsewhere}"
    )


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0] if name.endswith((".png", ".json", ".yaml")) else name


__all__ = [
    "BIAS_FILE",
    "DRIFT_FILE",
    "HEATMAP_FILE",
    "LAUNCH_FILES",
    "LAUNCH_LOG",
    "LOCK_FILE",
    "MAX_OVER_IDEAL_FILE",
    "METRICS_FILE",
    "MLFLOW_ARTIFACTS_DIR",
    "MLFLOW_DB",
    "NEMORUN_DIR",
    "OVER_STEPS_FILE",
    "PICTURES",
    "RECIPE_FILE",
    "REPORT_PAGE_FILE",
    "ROLLOUT_STORE_FILE",
    "ROLLOUT_VS_TRAIN_FILE",
    "ROUTER_HEALTH_FILE",
    "ROUTING_DISAGREEMENT_FILE",
    "RUN_FILE",
    "RUN_FILES",
    "RUN_RECORD",
    "STORE_FILE",
    "SWEEP_FILE",
    "TENSORBOARD_DIR",
    "TRACKIO_DIR",
    "WANDB_DIR",
    "is_run_file",
    "linked_run_files",
    "links_refusal",
]
