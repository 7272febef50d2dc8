"""Every name a run writes into its run directory, in one place.

A run directory (``<--output-dir>/<recipe name>/``) holds only these entries: the sinks' records
(:data:`RUN_RECORD`: ``metrics.jsonl``, the expert-load store, ``run.json``, TensorBoard, W&B,
MLflow, trackio, the pictures ``report`` draws and its page ``report.html``), what the launcher writes (:data:`LAUNCH_FILES`:
``recipe.yaml``, ``launch.log``, nemo-run's state) and the lock (``.run.lock``, which also
marks the directory as a run's, even one that failed before it logged a step). Deleting a run
deletes these names and nothing else; a directory that holds anything else is not a run's
(:mod:`nemo_moe_metrics.run_dir`).
"""

from __future__ import annotations

import os
import re
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


#: The longest run name: the name is a directory and a prefix of tracker run names; every file
#: system here takes 255 bytes per component, and the run's own files add their names below.
MAX_RUN_NAME = 100
# POSIX's portable file name characters; the first one neither hides the directory (.) nor
# reads as an option (-).
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def check_run_name(name: str) -> str:
    """``name`` when it can be a run directory's name (one path component of the portable
    characters ``A-Z a-z 0-9 . _ -``, not starting with ``.`` or ``-``, at most
    :data:`MAX_RUN_NAME` characters); else ValueError saying what is wrong and what to do."""
    fix = "give a name such as grpo_moe_tiny_v2 (letters, digits, '.', '_', '-')"
    if not name or name in (".", ".."):
        problem = f"{name!r} names no directory of its own"
    elif "/" in name or "\\" in name:
        problem = f"{name!r} holds a path separator, so the run would leave --output-dir"
    elif len(name) > MAX_RUN_NAME:
        problem = f"{len(name)} characters is longer than the {MAX_RUN_NAME} a run name may have"
    elif not _RUN_NAME.fullmatch(name):
        bad = sorted({c for c in name if not re.fullmatch(r"[A-Za-z0-9._-]", c)})
        problem = (
            f"{name!r} starts with '.' or '-'"
            if not bad
            else f"{name!r} holds {', '.join(repr(c) for c in bad)}, outside the characters "
            "every file system and tracker takes"
        )
    else:
        return name
    raise ValueError(f"{problem}; the name is the run directory's name under --output-dir: {fix}")


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
    "MAX_RUN_NAME",
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
    "check_run_name",
    "is_run_file",
    "linked_run_files",
    "links_refusal",
]
