"""MLflow sink: scalars as MLflow metrics with their step, tables as CSV artifacts.

By default the tracking store is a SQLite database inside the run directory
(``sqlite:///<run_dir>/mlflow.db``) and the artifacts live beside it (``mlflow_artifacts/``), so
a run directory stays self-contained; ``logger.mlflow_tracking_uri`` points it at a tracking
server or another database instead. Open the local one with
``mlflow ui --backend-store-uri sqlite:///runs/<name>/mlflow.db``.

Each table step writes one artifact ``expert_loads/step_<step>.csv`` with the columns of
``metric_names.TABLE_COLUMNS`` (``layer,expert,tokens,load_percent``): the same rows the
expert-load store keeps, never one metric series per expert.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from nemo_moe_metrics.export.metric_names import TABLE_COLUMNS
from nemo_moe_metrics.runtime.extras import check_extra, require
from nemo_moe_metrics.sinks.base import Metrics, SinkBase, split_tables

MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlflow_artifacts"
# MLflow refuses more than 1,000 metrics in one log_batch call.
_BATCH = 1000


def default_tracking_uri(run_dir: Path) -> str:
    """``sqlite:///<absolute run_dir>/mlflow.db``: the tracking store when none is configured."""
    return f"sqlite:///{(Path(run_dir).resolve() / MLFLOW_DB).as_posix()}"


def table_artifact_path(key: str) -> str:
    """The artifact folder of table ``key`` (``moe/expert_loads`` -> ``expert_loads``)."""
    return key.rsplit("/", 1)[-1]


class MlflowSink(SinkBase):
    """One MLflow run per sink; ``run_id`` given with ``resume`` continues that run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        experiment: str = "nemo_moe_metrics",
        tracking_uri: str | None = None,
        config: dict[str, Any] | None = None,
        table_every: int = 1,
        run_id: str | None = None,
        resume: bool = False,
    ) -> None:
        """Open (or, with ``resume`` and ``run_id``, reopen) the MLflow run.

        ``tracking_uri`` None: a SQLite database in ``run_dir`` with the artifacts beside it.
        ``self.run_id`` is the MLflow run id, which ``build_sinks`` keeps in ``run.json``.
        """
        if isinstance(table_every, bool) or not isinstance(table_every, int) or table_every < 1:
            raise ValueError(f"table_every must be an int >= 1, got {table_every!r}")
        self.table_every = table_every
        # Imported here: mlflow is optional and takes seconds to import.
        check_extra("mlflow", "the MLflow sink (logger.mlflow_enabled)")
        tracking = require("mlflow.tracking", "mlflow", "the MLflow sink (logger.mlflow_enabled)")
        entities = require("mlflow.entities", "mlflow", "the MLflow sink (logger.mlflow_enabled)")
        self._Metric = entities.Metric

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or default_tracking_uri(run_dir)
        # The first open of a new SQLite store creates MLflow's tables (its schema migrations:
        # a few seconds, once per database).
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        if resume and run_id:
            run = self.client.get_run(run_id)  # raises when the store has no such run
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                location = None
                if tracking_uri is None:
                    location = (run_dir.resolve() / MLFLOW_ARTIFACTS_DIR).as_uri()
                experiment_id = self.client.create_experiment(
                    experiment, artifact_location=location
                )
            run = self.client.create_run(experiment_id, run_name=run_name)
            self.run_id = run.info.run_id
            if config:
                self._log_config(config)
        self._closed = False

    def _log_config(self, config: dict[str, Any]) -> None:
        # The whole recipe as one artifact (nested, any size); params would cap values at 6,000
        # characters and 100 per call.
        self.client.log_dict(self.run_id, config, "config.json")

    def wants_tables(self, step: int) -> bool:
        """Whether ``step`` is on this sink's table cadence."""
        return step % self.table_every == 0

    def log(self, metrics: Metrics, step: int) -> None:
        """Log every scalar at ``step`` in batched calls; on table steps, one CSV per table."""
        scalars, tables = split_tables(metrics)
        now = int(time.time() * 1000)
        batch = [self._Metric(key, float(v), now, step) for key, v in scalars.items()]
        for start in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start : start + _BATCH])
        if tables and step % self.table_every == 0:
            for key, rows in tables.items():
                self._log_table(key, rows, step)

    def _log_table(self, key: str, rows: list[list], step: int) -> None:
        header = ",".join(TABLE_COLUMNS[key])
        lines = [header, *(",".join(map(repr, row)) for row in rows)]
        with tempfile.TemporaryDirectory(prefix="nmm_mlflow_") as tmp:
            path = Path(tmp) / f"step_{step:08d}.csv"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            self.client.log_artifact(self.run_id, str(path), table_artifact_path(key))

    def close(self) -> None:
        """Mark the run finished; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)
