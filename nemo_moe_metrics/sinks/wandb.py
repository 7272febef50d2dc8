"""Weights & Biases sink: scalars, and each table as a ``wandb.Table`` with every row kept.

W&B truncates a logged table to ``wandb.Table.MAX_ROWS`` rows (10,000 by default), which is
fewer than one step of a 40-layer, 256-expert model (10,240 rows). The sink raises that
class-wide limit to the size of the table it is about to log, so no row is lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.export.expert_table import ExpertTable
from nemo_moe_metrics.export.metric_names import TABLE_COLUMNS
from nemo_moe_metrics.runtime.extras import require
from nemo_moe_metrics.sinks.base import Metrics, SinkBase, split_tables


class WandbSink(SinkBase):
    """One W&B run per sink; ``mode`` is ``offline`` (no account needed), ``online`` or
    ``disabled``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        mode: str,
        project: str,
        run_name: str,
        config: dict[str, Any] | None = None,
        table_every: int = 1,
        run_id: str | None = None,
        resume: bool = False,
    ) -> None:
        """``run_id`` names the W&B run (kept in ``run.json``); with ``resume`` the sink continues
        that run (online: W&B appends to it; offline: a new offline folder with the same id,
        which ``wandb sync`` merges into the one run)."""
        if isinstance(table_every, bool) or not isinstance(table_every, int) or table_every < 1:
            raise ValueError(f"table_every must be an int >= 1, got {table_every!r}")
        # A 64 x 256 table costs W&B 0.5 to 1 s of host time per log (type inference and two
        # serialisations); big runs can send it every N steps. Scalars always go every step.
        self.table_every = table_every
        # Imported here: wandb is heavy and optional for users who log elsewhere.
        wandb = require("wandb", "wandb", "the W&B sink (logger.wandb_enabled)")

        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._dir = run_dir / "wandb"  # where wandb.init(dir=run_dir) keeps its runs
        self.run = wandb.init(
            mode=mode,
            dir=str(run_dir),
            project=project,
            name=run_name,
            config=config or {},
            id=run_id,
            # "allow": continue the run with this id when it exists, create it otherwise.
            resume="allow" if resume else None,
            # create_new: several sinks (tests, sweeps) may live in one process.
            reinit="create_new",
            # console="off": the training script's stdout stays untouched.
            settings=wandb.Settings(console="off", silent=True),
        )

    def wants_tables(self, step: int) -> bool:
        """Whether ``step`` is on this sink's table cadence."""
        return step % self.table_every == 0

    def location(self) -> str:
        """The run directory's ``wandb/`` folder (W&B copies its files into it)."""
        return str(self._dir)

    def log(self, metrics: Metrics, step: int) -> None:
        """Log scalars (and tables when ``step`` is a multiple of ``table_every``) for ``step``."""
        data, tables = split_tables(metrics)
        if step % self.table_every:
            tables = {}
        for key, value in tables.items():
            if len(value) > self._wandb.Table.MAX_ROWS:
                self._wandb.Table.MAX_ROWS = len(value)
            data[key] = self._table(key, value)
        # commit=True: the row is written now, not held back until the next step arrives.
        self.run.log(data, step=step, commit=True)

    def _table(self, key: str, rows: Any) -> Any:
        """A ``wandb.Table`` of numeric ``rows`` with every column typed as a number.

        W&B's own constructor infers each cell's type row by row (0.4 s of host time for a
        94 x 256 table, most of the table's cost); the cells of our tables are numbers by
        construction, so the columns are declared as numbers (what the inference concludes)
        and the rows are checked in one numpy pass instead: a missing or non-numeric cell, or a
        row of the wrong length, is refused as W&B would refuse it.
        """
        columns = list(TABLE_COLUMNS[key])
        checked = isinstance(rows, ExpertTable)  # numbers by construction, checked as arrays
        rows = list(rows)
        if rows and not checked:
            try:
                cells = np.asarray(rows, dtype=np.float64)
            except (TypeError, ValueError) as err:
                raise TypeError(f"{key}: every row must hold {len(columns)} numbers") from err
            # numpy reads None as NaN: look for it (W&B refuses None in a non-optional column).
            if cells.shape != (len(rows), len(columns)) or any(None in r for r in rows):
                raise TypeError(
                    f"{key}: every row must hold {len(columns)} numbers ({columns}), none "
                    f"missing; got cells of shape {cells.shape}"
                )
        table = self._wandb.Table(columns=columns, optional=False, dtype=[float] * len(columns))
        table.data = [list(r) for r in rows]
        return table

    def close(self) -> None:
        """Finish the run (offline: the files are complete on disk afterwards)."""
        self.run.finish()
