"""Metric sinks (JSONL, TensorBoard, W&B, MLflow) behind one small interface, built from the recipe.

``build_sinks`` is the only constructor call sites need: it returns one ``Sink`` whose ``log``
fans out to every enabled backend, or a do-nothing sink on ranks other than 0. It also writes
``run.json`` (run name, run id, model shape, config) that ``nemo-moe-metrics report`` reads.

The local record is ``metrics.jsonl`` (scalars, every step) plus the expert-load store beside
it (``expert_loads.bin``: the ``moe/expert_loads`` counts every ``logger.table_every`` steps).
Each step goes to the JSONL last, so a step in ``metrics.jsonl`` is in every other sink too: a
run killed mid-step is continued from its last JSONL line (:func:`prepare_resume`). A write
that fails for lack of space or a disk error ends the run (:class:`SinkWriteError`).
"""

from __future__ import annotations

import json
import secrets
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nemo_moe_metrics import run_files
from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.durable import write_text_durably
from nemo_moe_metrics.run_files import RUN_FILE, TENSORBOARD_DIR
from nemo_moe_metrics.sinks.base import (
    MultiSink,
    NullSink,
    Sink,
    SinkWriteError,
    split_tables,
    validate_metrics,
)
from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink
from nemo_moe_metrics.sinks.resume import (
    ResumeError,
    ResumeState,
    prepare_resume,
    read_resume_state,
    recover_run_id,
)
from nemo_moe_metrics.sinks.run_record import (
    RunExistsError,
    clear_run,
    logged_run,
    refuse_logged_run,
)
from nemo_moe_metrics.sinks.store import STORE_FILE, ExpertLoadSink, store_path

# What a run writes into its directory (sinks and report pictures, named in run_files.py);
# ``overwrite`` deletes these and nothing else, so an API user's own files are left alone.
RUN_RECORD = run_files.RUN_RECORD


__all__ = [
    "METRICS_FILE",
    "RUN_FILE",
    "STORE_FILE",
    "TENSORBOARD_DIR",
    "MultiSink",
    "NullSink",
    "ResumeError",
    "ResumeState",
    "Sink",
    "SinkWriteError",
    "RunExistsError",
    "build_sinks",
    "clear_run",
    "logged_run",
    "prepare_resume",
    "read_resume_state",
    "run_metadata",
    "split_tables",
    "store_path",
    "validate_metrics",
]


def build_sinks(
    logger_cfg: LoggerConfig,
    run_dir: Path,
    *,
    run_name: str,
    config: dict[str, Any] | None = None,
    rank: int = 0,
    resume_state: ResumeState | None = None,
    overwrite: bool = False,
) -> Sink:
    """The sinks ``logger_cfg`` enables, writing under ``run_dir``; rank != 0 gets a NullSink.

    A backend that cannot start (W&B most often) warns once and is left out; the others run.
    The ``moe/expert_loads`` table goes to the store and W&B on steps that are multiples of
    ``logger_cfg.table_every`` (W&B: ``wandb_table_every`` when set); scalars go every step.
    With ``logger_cfg.resume`` the run in ``run_dir`` continues (``resume_state``, read from
    ``run_dir`` when not given, says from which step): see :mod:`nemo_moe_metrics.sinks.resume`.
    ``logger_cfg.alerts.enabled`` adds the alert monitor (:mod:`nemo_moe_metrics.sinks.alerts`)
    in front of the backends: every loop that logs through this sink gets ``moe/alerts``.

    One run per directory, as ``nemo-moe-metrics run``: when ``run_dir`` already holds a run
    that logged steps, :class:`RunExistsError` is raised unless ``logger_cfg.resume`` (continue
    it) or ``overwrite`` (delete its files, :data:`RUN_RECORD`, first). A run that failed before
    logging anything does not count.
    """
    if rank != 0:
        return NullSink()
    run_dir = Path(run_dir)
    resume = logger_cfg.resume
    if resume and overwrite:
        raise ValueError(
            "build_sinks: LoggerConfig(resume=True) and overwrite=True exclude each other"
        )
    refuse_logged_run(
        run_dir,
        resume=resume or overwrite,
        ways="build_sinks would append a second run to it. Pass LoggerConfig(resume=True) to "
        "continue it (recipes: logger.resume=true), build_sinks(..., overwrite=True) to delete "
        "it and start afresh, or choose another run directory",
    )
    links = run_files.linked_run_files(run_dir)
    if links:  # checked before anything is written or deleted: nothing goes through a link
        raise RunExistsError(run_files.links_refusal(links, "choose another run directory"))
    if overwrite:
        clear_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume and resume_state is None:
        resume_state, notes = prepare_resume(run_dir, table_every=logger_cfg.table_every)
        for note in notes:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    previous = _read_run_json(run_dir / RUN_FILE) if resume else {}
    if (
        resume
        and not previous.get("run_id")
        and resume_state
        and resume_state.last_step is not None
    ):
        run_id, note = recover_run_id(run_dir)
        previous = {"run_id": run_id} if run_id else {}
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    meta = run_metadata(run_name, config)
    # The run id (W&B's too) survives a resume; a run that does not resume gets a new one.
    meta["run_id"] = previous.get("run_id") or secrets.token_hex(4)
    if resume and previous:
        meta["created"] = previous.get("created", meta["created"])
        meta["resumed"] = [*previous.get("resumed", []), _now()]
        for key in ("mlflow_run_id", "mlflow_tracking_uri"):
            if key in previous:
                meta[key] = previous[key]
    _write_json_atomic(run_dir / RUN_FILE, meta)
    next_step = resume_state.next_step if resume and resume_state is not None else None

    sinks: list[Sink] = []
    jsonl: list[Sink] = []
    if logger_cfg.jsonl_enabled:
        # No guard: the local file is the record of last resort; failing to open it is fatal.
        jsonl.append(JsonlSink(run_dir / METRICS_FILE))
        sinks.append(ExpertLoadSink(store_path(run_dir), table_every=logger_cfg.table_every))
    if logger_cfg.tensorboard_enabled:
        _try_add(sinks, "TensorBoard", lambda: _tensorboard(run_dir / TENSORBOARD_DIR, next_step))
    if logger_cfg.wandb_enabled and logger_cfg.wandb_mode != "disabled":
        _try_add(
            sinks,
            "W&B",
            lambda: _wandb(run_dir, logger_cfg, run_name, config, meta["run_id"]),
        )
    if logger_cfg.mlflow_enabled:
        # The MLflow run id lives in run.json beside ours; a resume reopens that run.
        mlflow_id = previous.get("mlflow_run_id") if resume else None
        added = _try_add(
            sinks,
            "MLflow",
            lambda: _mlflow(run_dir, logger_cfg, run_name, config, mlflow_id),
        )
        if added is not None:
            meta["mlflow_run_id"] = added.run_id
            meta["mlflow_tracking_uri"] = added.tracking_uri
            _write_json_atomic(run_dir / RUN_FILE, meta)
    if logger_cfg.trackio_enabled:
        _try_add(sinks, "trackio", lambda: _trackio(run_dir, run_name, config, resume))
    # The JSONL goes last: a step it holds is complete in every sink (what resume relies on).
    return MultiSink(sinks + jsonl, monitor=_alert_monitor(logger_cfg))


def _alert_monitor(logger_cfg: LoggerConfig) -> Any:
    # Rank 0 only (other ranks returned above): alerts read the logged numbers, nothing else.
    if not logger_cfg.alerts.enabled:
        return None
    from nemo_moe_metrics.sinks.alerts import AlertMonitor

    return AlertMonitor(logger_cfg.alerts)


def run_metadata(run_name: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """What ``run.json`` holds: the run name, the model's MoE shape when known, the config."""
    model = ((config or {}).get("policy") or {}).get("model") or {}
    return {
        "run_name": run_name,
        "created": _now(),
        "num_layers": model.get("num_layers"),
        "num_experts": model.get("num_experts"),
        "moe_router_topk": model.get("moe_router_topk"),
        "config": config or {},
    }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _read_run_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _tensorboard(log_dir: Path, purge_step: int | None) -> Sink:
    from nemo_moe_metrics.sinks.tensorboard import TensorBoardSink

    return TensorBoardSink(log_dir, purge_step=purge_step)


def _wandb(
    run_dir: Path,
    cfg: LoggerConfig,
    run_name: str,
    config: dict[str, Any] | None,
    run_id: str,
) -> Sink:
    from nemo_moe_metrics.sinks.wandb import WandbSink

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
    from nemo_moe_metrics.sinks.mlflow import MlflowSink

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


def _trackio(run_dir: Path, run_name: str, config: dict[str, Any] | None, resume: bool) -> Any:
    from nemo_moe_metrics.sinks.trackio import TrackioSink

    return TrackioSink(run_dir, run_name=run_name, config=config, resume=resume)


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
            stacklevel=3,
        )
        return None
    sinks.append(sink)
    return sink


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Write-then-rename, fsync'd: a crash or a disk error never leaves a cut or empty run.json.
    write_text_durably(path, json.dumps(data, indent=2, default=str))
