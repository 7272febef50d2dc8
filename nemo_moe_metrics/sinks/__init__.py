"""Metric sinks (JSONL, TensorBoard, W&B) behind one small interface, built from the recipe.

``build_sinks`` is the only constructor call sites need: it returns one ``Sink`` whose ``log``
fans out to every enabled backend, or a do-nothing sink on ranks other than 0. It also writes
``run.json`` (run name, model shape, config) that ``nemo-moe-metrics report`` reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.sinks.base import MultiSink, NullSink, Sink, validate_metrics
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink

RUN_FILE = "run.json"
TENSORBOARD_DIR = "tensorboard"

__all__ = [
    "METRICS_FILE",
    "RUN_FILE",
    "TENSORBOARD_DIR",
    "MultiSink",
    "NullSink",
    "Sink",
    "build_sinks",
    "run_metadata",
    "validate_metrics",
]


def build_sinks(
    logger_cfg: LoggerConfig,
    run_dir: Path,
    *,
    run_name: str,
    config: dict[str, Any] | None = None,
    rank: int = 0,
) -> Sink:
    """The sinks ``logger_cfg`` enables, writing under ``run_dir``; rank != 0 gets a NullSink.

    A backend that cannot start (W&B most often) warns once and is left out; the others run.
    ``logger_cfg.wandb_table_every=N`` sends the expert table to W&B every N steps only (it
    costs 0.5 to 1 s of host time per step at 64 x 256); JSONL always keeps every step's table.
    ``logger_cfg.alerts.enabled`` adds the alert monitor (:mod:`nemo_moe_metrics.moe.alerts`)
    in front of the backends: every loop that logs through this sink gets ``moe/alerts``.
    """
    if rank != 0:
        return NullSink()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(run_dir / RUN_FILE, run_metadata(run_name, config))

    sinks: list[Sink] = []
    if logger_cfg.jsonl_enabled:
        # No guard: the local file is the record of last resort; failing to open it is fatal.
        sinks.append(JsonlSink(run_dir / METRICS_FILE))
    if logger_cfg.tensorboard_enabled:
        _try_add(sinks, "TensorBoard", lambda: _tensorboard(run_dir / TENSORBOARD_DIR))
    if logger_cfg.wandb_enabled and logger_cfg.wandb_mode != "disabled":
        _try_add(
            sinks,
            "W&B",
            lambda: _wandb(run_dir, logger_cfg, run_name, config, logger_cfg.wandb_table_every),
        )
    return MultiSink(sinks, monitor=_alert_monitor(logger_cfg))


def _alert_monitor(logger_cfg: LoggerConfig) -> Any:
    # Rank 0 only (other ranks returned above): alerts read the logged numbers, nothing else.
    if not logger_cfg.alerts.enabled:
        return None
    from nemo_moe_metrics.moe.alerts import AlertMonitor

    return AlertMonitor(logger_cfg.alerts)


def run_metadata(run_name: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """What ``run.json`` holds: the run name, the model's MoE shape when known, the config."""
    model = ((config or {}).get("policy") or {}).get("model") or {}
    return {
        "run_name": run_name,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "num_layers": model.get("num_layers"),
        "num_experts": model.get("num_experts"),
        "moe_router_topk": model.get("moe_router_topk"),
        "config": config or {},
    }


def _tensorboard(log_dir: Path) -> Sink:
    from nemo_moe_metrics.sinks.tensorboard import TensorBoardSink

    return TensorBoardSink(log_dir)


def _wandb(
    run_dir: Path,
    cfg: LoggerConfig,
    run_name: str,
    config: dict[str, Any] | None,
    table_every: int,
) -> Sink:
    from nemo_moe_metrics.sinks.wandb import WandbSink

    return WandbSink(
        run_dir,
        mode=cfg.wandb_mode,
        project=cfg.wandb_project,
        run_name=run_name,
        config=config,
        table_every=table_every,
    )


def _try_add(sinks: list[Sink], name: str, make: Any) -> None:
    try:
        sinks.append(make())
    except Exception as err:  # a logging backend must never stop training
        warnings.warn(
            f"{name} sink could not start ({type(err).__name__}: {err}); continuing without it. "
            f"Set logger.{'wandb' if name == 'W&B' else 'tensorboard'}_enabled=false to silence "
            "this warning.",
            RuntimeWarning,
            stacklevel=3,
        )


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Write-then-rename: a crash never leaves a half-written run.json behind.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; run.json is meant to be shared
    os.replace(tmp, path)
