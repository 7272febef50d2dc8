"""Opening a run directory: the one way every writer starts or continues a run.

:func:`open_run` is what the main job's rank 0, the Trainer and Megatron-Bridge callbacks, the
torchtitan example and ``build_sinks`` all call. In one place it:

1. refuses a directory that already holds a run that logged steps, unless the run is to be
   continued (``logger.resume``) or replaced (``overwrite``), and any of the run's own files
   that is a symbolic link (:mod:`~nemo_moe_metrics.run_dir.record`);
2. takes the directory's owner lock (:class:`~nemo_moe_metrics.run_dir.lock.RunDirLock`), so a
   second writer, in this process or any other, on this host or another, is refused naming
   the holder (command, pid, host, since when), unless the caller already holds it (``lock``);
3. deletes the old run's own files for ``overwrite``, or, for a resume, makes the records agree
   and reads where to continue (:func:`~nemo_moe_metrics.run_dir.resume.prepare_resume`);
4. writes ``run.json`` (:mod:`~nemo_moe_metrics.run_dir.run_json`): the run id a resume keeps,
   the model's MoE shape from the metrics' facts, the writer's config;
5. builds the sinks the logger config turns on (:func:`~nemo_moe_metrics.sinks.fanout.make_sinks`).

The :class:`RunSession` it returns is the fan-out sink itself (``log(metrics, step)``,
``close()``); closing it stores the last logged step's expert-load table when the
``table_every`` cadence left it out (a run shorter than the cadence still has one table for
``report`` and ``placement``), then gives the lock back when :func:`open_run` took it.
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_moe_metrics.adapters.family import ModelFacts
from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export.metric_names import EXPERT_LOADS
from nemo_moe_metrics.run_dir.lock import RunDirBusyError, RunDirLock
from nemo_moe_metrics.run_dir.names import linked_run_files, links_refusal
from nemo_moe_metrics.run_dir.record import RunExistsError, clear_run, refuse_logged_run
from nemo_moe_metrics.run_dir.resume import ResumeState, prepare_resume, recover_run_id
from nemo_moe_metrics.run_dir.run_json import (
    TABLES_LOGGED,
    now,
    read_run_json,
    run_metadata,
    write_run_json,
)
from nemo_moe_metrics.sinks.base import (
    Metrics,
    MultiSink,
    NullSink,
    Sink,
    StepMonitor,
    validate_metrics,
)
from nemo_moe_metrics.sinks.fanout import make_sinks
from nemo_moe_metrics.sinks.store import ExpertLoadSink


def api_ways(call: str) -> str:
    """What a refusal says to do, in the Python API's terms (``call``: the function the user
    called); callers in other terms (a recipe, a command line) pass their own ``ways``."""
    return (
        f"{call} would append a second run to it. Pass LoggerConfig(resume=True) to continue "
        f"it (recipes: logger.resume=true), {call}(..., overwrite=True) to delete it and start "
        "afresh, or choose another run directory"
    )


class RunSession(MultiSink):
    """An open run directory: the fan-out of its sinks, plus where the run continues from.

    Attributes: ``run_dir``; ``resume_state`` (None for a new run); ``meta`` (what
    ``run.json`` holds). ``close()`` stores the last step's table if the cadence left it out,
    closes every sink, then gives the lock back when :func:`open_run` took it.
    """

    def __init__(
        self,
        sinks: list[Sink],
        *,
        monitor: StepMonitor | None,
        run_dir: Path,
        resume_state: ResumeState | None,
        meta: dict[str, Any],
        lock: RunDirLock | None,
    ) -> None:
        super().__init__(sinks, monitor=monitor)
        self.run_dir = run_dir
        self.resume_state = resume_state
        self.meta = meta
        self._lock = lock
        # The last logged step's table while the store has not taken it (off its cadence):
        # a reference, kept until close() stores it or a step on the cadence replaces it.
        self._unstored: tuple[Any, int] | None = None

    def log(self, metrics: Metrics, step: int) -> None:
        """Log one step to every sink (see :class:`MultiSink`)."""
        super().log(metrics, step)
        table = metrics.get(EXPERT_LOADS) if isinstance(metrics, Mapping) else None
        if table is not None and not self.meta.get(TABLES_LOGGED):
            # Once: run.json says the run makes tables, so a report of a run that stored none
            # yet (killed before its cadence) says what happened, not which flag to turn on.
            self.meta[TABLES_LOGGED] = True
            write_run_json(self.run_dir, self.meta)
        store = self._store()
        if table is None or store is None or store.wants_tables(int(step)):
            self._unstored = None
        else:
            self._unstored = (table, int(step))

    def _store(self) -> ExpertLoadSink | None:
        return next((s for s in self.sinks if isinstance(s, ExpertLoadSink)), None)

    def record(self, **fields: Any) -> None:
        """Add top-level fields to ``run.json`` (e.g. where each rank runs), kept by every
        later write of it."""
        self.meta.update(fields)
        write_run_json(self.run_dir, self.meta)

    @property
    def next_step(self) -> int:
        """The first step this run logs (0 for a new run)."""
        return self.resume_state.next_step if self.resume_state is not None else 0

    def close(self) -> None:
        """Store the last step's table if the cadence left it out (the end of training, a
        clean stop, or an error after the last complete step), flush and close every sink,
        then release the lock this session took."""
        try:
            if not self._closed and self._unstored is not None:
                table, step = self._unstored
                self._unstored = None
                try:  # dropped before validation when logged (no sink wanted it): checked now
                    table = validate_metrics({EXPERT_LOADS: table}, step)[EXPERT_LOADS]
                except (TypeError, ValueError) as err:
                    warnings.warn(
                        f"the last step's ({step}) expert-load table is not stored: {err}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                else:
                    self._guarded(self._store(), "log_table", table, step)
            super().close()
        finally:
            if self._lock is not None:
                lock, self._lock = self._lock, None
                lock.release()


def open_run(
    run_dir: str | Path,
    logger: LoggerConfig,
    facts: ModelFacts | None = None,
    *,
    run_name: str | None = None,
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
    lock: RunDirLock | None = None,
    resume_state: ResumeState | None = None,
    ways: str | None = None,
    extra: dict[str, Any] | None = None,
    resume_after: int | None = None,
) -> RunSession:
    """Open ``run_dir`` for the one process that writes it (see the module docstring).

    Args:
        logger: which sinks, and ``resume`` (continue the run there).
        facts: ``PolicyMetrics.facts``, the model's MoE shape for ``run.json``.
        run_name: the run's name in ``run.json`` and the trackers (default: the directory's).
        config: what ``run.json`` keeps as the run's config (a recipe's dump, or the
            integration's settings).
        overwrite: delete the run there first (its own files only).
        lock: the directory's lock when the caller already holds it (a launcher's rank 0);
            None: this call takes it, and closing the session gives it back.
        resume_state: where to continue, when the caller already prepared the resume.
        ways: what a refusal tells the user to do, in the caller's terms (default: the
            Python API's, :func:`api_ways`).
        extra: more top-level ``run.json`` fields (e.g. the node of each rank).
        resume_after: with ``logger.resume``, the step the training continues after (the
            step of the checkpoint it restored): the records of later steps are cut, so each
            step is logged once and the running totals continue from that step's
            (:func:`~nemo_moe_metrics.run_dir.resume.prepare_resume`).
    """
    run_dir = Path(run_dir)
    resume = logger.resume
    if resume and overwrite:
        raise ValueError(
            "open_run: LoggerConfig(resume=True) and overwrite=True exclude each other"
        )
    if lock is None:
        _refuse_a_live_writer(run_dir)  # first: a busy directory is refused naming its owner
    refuse_logged_run(run_dir, resume=resume or overwrite, ways=ways or api_ways("open_run"))
    links = linked_run_files(run_dir)
    if links:  # checked before anything is written or deleted: nothing goes through a link
        raise RunExistsError(links_refusal(links, "choose another run directory"))
    owned = None
    if lock is None:
        owned = lock = RunDirLock(run_dir).acquire(writer=True)
        for note in lock.notes:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    try:
        if owned is not None:
            owned.mark_run()
        if overwrite:
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume and resume_state is None:
            resume_state, notes = prepare_resume(
                run_dir, table_every=logger.table_every, resume_after=resume_after
            )
            for note in notes:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        meta = _run_json(run_dir, run_name or run_dir.name, config, facts, resume, resume_state)
        meta.update(extra or {})
        write_run_json(run_dir, meta)
        state = resume_state if resume else None
        fanout, mlflow = make_sinks(
            logger,
            run_dir,
            run_name=meta["run_name"],
            config=config,
            run_id=meta["run_id"],
            next_step=state.next_step if state is not None else None,
            mlflow_run_id=meta.get("mlflow_run_id") if resume else None,
        )
        if mlflow is not None:
            meta["mlflow_run_id"] = mlflow.run_id
            meta["mlflow_tracking_uri"] = mlflow.tracking_uri
            write_run_json(run_dir, meta)
    except BaseException:
        if owned is not None:
            owned.release()
        raise
    return RunSession(
        fanout.sinks,
        monitor=fanout.monitor,
        run_dir=run_dir,
        resume_state=state,
        meta=meta,
        lock=owned,
    )


def _refuse_a_live_writer(run_dir: Path) -> None:
    """:class:`RunDirBusyError` naming the holder when a live writer (this process or another)
    holds ``run_dir``; nothing is written either way."""
    holder = RunDirLock.probe(run_dir)
    if holder is not None:
        raise RunDirBusyError(
            f"{run_dir} is in use by another writer: {holder.describe()}. One writer per run "
            "directory: wait for it to end, or stop it, then continue the run; or choose "
            "another run directory"
        )


def _run_json(
    run_dir: Path,
    run_name: str,
    config: dict[str, Any] | None,
    facts: ModelFacts | None,
    resume: bool,
    state: ResumeState | None,
) -> dict[str, Any]:
    """The new ``run.json``; a resume keeps the run id, creation time and MLflow run."""
    previous = read_run_json(run_dir) if resume else {}
    if resume and not previous.get("run_id") and state is not None and state.last_step is not None:
        run_id, note = recover_run_id(run_dir)
        previous = {"run_id": run_id} if run_id else {}
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    meta = run_metadata(run_name, config, facts)
    # The run id (W&B's too) survives a resume; a run that does not resume gets a new one.
    meta["run_id"] = previous.get("run_id") or secrets.token_hex(4)
    if resume and previous:
        meta["created"] = previous.get("created", meta["created"])
        meta["resumed"] = [*previous.get("resumed", []), now()]
        for key in ("mlflow_run_id", "mlflow_tracking_uri", TABLES_LOGGED):
            if key in previous:
                meta[key] = previous[key]
    return meta


def build_sinks(
    logger_cfg: LoggerConfig,
    run_dir: Path,
    *,
    run_name: str,
    config: dict[str, Any] | None = None,
    rank: int = 0,
    resume_state: ResumeState | None = None,
    overwrite: bool = False,
    facts: ModelFacts | None = None,
    lock: RunDirLock | None = None,
) -> Sink:
    """The sinks ``logger_cfg`` enables, writing under ``run_dir``; rank != 0 gets a NullSink.

    :func:`open_run` on rank 0 (the directory's lock included: a second writer is refused),
    a do-nothing sink elsewhere, so every rank calls it the same way. A backend that cannot
    start (W&B most often) warns once and is left out; the others run. The
    ``moe/expert_loads`` table goes to the store and W&B on steps that are multiples of
    ``logger_cfg.table_every`` (W&B: ``wandb_table_every`` when set); scalars go every step.
    ``logger_cfg.alerts.enabled`` adds the alert monitor (:mod:`nemo_moe_metrics.sinks.alerts`)
    in front of the backends.

    One run per directory, as ``nemo-moe-metrics run``: when ``run_dir`` already holds a run
    that logged steps, :class:`~nemo_moe_metrics.run_dir.record.RunExistsError` is raised
    unless ``logger_cfg.resume`` (continue it, see :mod:`nemo_moe_metrics.run_dir.resume`) or
    ``overwrite`` (delete its files first). A run that failed before logging anything does not
    count.
    """
    if rank != 0:
        return NullSink()
    return open_run(
        run_dir,
        logger_cfg,
        facts,
        run_name=run_name,
        config=config,
        overwrite=overwrite,
        lock=lock,
        resume_state=resume_state,
        ways=api_ways("build_sinks"),
    )


__all__ = ["api_ways", "RunSession", "build_sinks", "open_run"]
