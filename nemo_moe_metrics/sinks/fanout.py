"""The sinks a ``LoggerConfig`` turns on, built into one fan-out (:func:`make_sinks`).

Only construction: which backends, in which order, and what a backend that cannot start does
(warns once and is left out). Whether a directory may be written, resumed or cleared, and
``run.json``, belong to the run directory's owner (:mod:`nemo_moe_metrics.run_dir.session`).
Each backend's library (TensorBoard, W&B, MLflow, trackio) is imported only when its sink starts.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.run_dir.names import TENSORBOARD_DIR
from nemo_moe_metrics.sinks.alerts import AlertMonitor
from nemo_moe_metrics.sinks.base import MultiSink, Sink
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink
from nemo_moe_metrics.sinks.mlflow import MlflowSink
from nemo_moe_metrics.sinks.store import ExpertLoadSink, store_path
from nemo_moe_metrics.sinks.tensorboard import TensorBoardSink
from nemo_moe_metrics.sinks.trackio import TrackioSink
from nemo_moe_metrics.sinks.wandb import WandbSink


def make_sinks(
    logger_cfg: LoggerConfig,
    run_dir: Path,
    *,
    run_name: str,
    config: dict[str, Any] | None,
    run_id: str,
    next_step: int | None = None,
    mlflow_run_id: str | None = None,
) -> tuple[MultiSink, Any]:
    """``(fan-out, the MLflow sink or None)`` of the backends ``logger_cfg`` enables under
    ``run_dir``. ``next_step``: a resumed run's first step (TensorBoard hides later events of
    the earlier process); ``mlflow_run_id``: the MLflow run a resume reopens."""
    sinks: list[Sink] = []
    jsonl: list[Sink] = []
    resume = logger_cfg.resume
    if logger_cfg.jsonl_enabled:
        # No guard: the local file is the record of last resort; failing to open it is fatal.
        jsonl.append(JsonlSink(run_dir / METRICS_FILE))
        sinks.append(ExpertLoadSink(store_path(run_dir), table_every=logger_cfg.table_every))
    if logger_cfg.tensorboard_enabled:
        _try_add(
            sinks,
            "TensorBoard",
            lambda: TensorBoardSink(run_dir / TENSORBOARD_DIR, purge_step=next_step),
        )
    if logger_cfg.wandb_enabled and logger_cfg.wandb_mode != "disabled":
        _try_add(sinks, "W&B", lambda: _wandb(run_dir, logger_cfg, run_name, config, run_id))
    mlflow = None
    if logger_cfg.mlflow_enabled:
        mlflow = _try_add(
            sinks,
            "MLflow",
            lambda: _mlflow(run_dir, logger_cfg, run_name, config, mlflow_run_id),
        )
    if logger_cfg.trackio_enabled:
        _try_add(
            sinks,
            "trackio",
            lambda: TrackioSink(run_dir, run_name=run_name, config=config, resume=resume),
        )
    # The JSONL goes last: a step it holds is complete in every sink (what resume relies on).
    # Rank 0 only: alerts read the logged numbers, nothing else.
    monitor = AlertMonitor(logger_cfg.alerts) if logger_cfg.alerts.enabled else None
    return MultiSink(sinks + jsonl, monitor=monitor), mlflow


def _wandb(
    run_dir: Path,
    cfg: LoggerConfig,
    run_name: str,
    config: dict[str, Any] | None,
    run_id: str,
) -> Sink:
    return WandbSink(
        run_dir,
        mode=cfg.wandb_mode,
        project=cfg.wandb_project,
        run_name=run_name,
        config=config,
        table_every=cfg.wandb_table_cadence,
        run_id=run_id,
        resume=cfg.resume,
    )


def _mlflow(
    run_dir: Path,
    cfg: LoggerConfig,
    run_name: str,
    config: dict[str, Any] | None,
    run_id: str | None,
) -> Any:
    return MlflowSink(
        run_dir,
        run_name=run_name,
        experiment=cfg.mlflow_experiment,
        tracking_uri=cfg.mlflow_tracking_uri,
        config=config,
        table_every=cfg.table_every,
        run_id=run_id,
        resume=cfg.resume,
    )


_FLAGS = {"W&B": "wandb", "TensorBoard": "tensorboard", "MLflow": "mlflow", "trackio": "trackio"}


def _try_add(sinks: list[Sink], name: str, make: Any) -> Any:
    """Append ``make()`` to ``sinks`` and return it; on failure warn and return None."""
    try:
        sink = make()
    except Exception as err:  # a logging backend must never stop training
        warnings.warn(
            f"{name} sink could not start ({type(err).__name__}: {err}); continuing without it. "
            f"Set logger.{_FLAGS[name]}_enabled=false to silence this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    sinks.append(sink)
    return sink


__all__ = ["make_sinks"]
