"""trackio sink: the scalars as a trackio run, in a SQLite store inside the run directory.

trackio (Hugging Face's local-first tracker, the one TRL's docs recommend) keeps a project as
one SQLite database under ``TRACKIO_DIR``, which it reads once, when it is first imported. The
sink therefore sets ``TRACKIO_DIR=<run_dir>/trackio`` before that import, and refuses (the sink
is then left out with a warning) when trackio was already imported pointing elsewhere: nothing
is written outside the run directory. No space id, no server URL: nothing goes over the
network. Open it with ``TRACKIO_DIR=<run_dir>/trackio trackio show``; read it in Python with
``trackio.sqlite_storage.SQLiteStorage.get_logs(project, run_name)``.

The ``moe/expert_loads`` table stays in the expert-load store (``expert_loads.bin``): trackio
gets the scalars only. trackio's current run (``trackio.log``, the Trainer's
``report_to="trackio"``) is left as it was: this sink logs through its own run object.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from nemo_moe_metrics.runtime.extras import require
from nemo_moe_metrics.sinks.base import Metrics, SinkBase, split_tables

TRACKIO_DIR = "trackio"
#: trackio's environment variable for its store (read once, at its first import)
TRACKIO_DIR_ENV = "TRACKIO_DIR"


def trackio_store(run_dir: Path) -> Path:
    """Where the sink keeps trackio's store for ``run_dir``."""
    return Path(run_dir).resolve() / TRACKIO_DIR


class TrackioSink(SinkBase):
    """One trackio run per sink, project ``project``, in ``<run_dir>/trackio``."""

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        project: str = "nemo_moe_metrics",
        config: dict[str, Any] | None = None,
        resume: bool = False,
    ) -> None:
        """Open the run (``resume``: continue the run of the same name)."""
        store = trackio_store(run_dir)
        if "trackio" not in sys.modules:
            os.environ[TRACKIO_DIR_ENV] = str(store)
        trackio = require("trackio", "trackio", "the trackio sink (logger.trackio_enabled)")
        utils = require("trackio.utils", "trackio", "the trackio sink (logger.trackio_enabled)")
        if Path(utils.TRACKIO_DIR).resolve() != store:
            raise RuntimeError(
                f"trackio was imported before the sink with its store at {utils.TRACKIO_DIR}, "
                f"outside the run directory; set {TRACKIO_DIR_ENV}={store} before anything "
                "imports trackio (e.g. report_to='trackio'), or turn logger.trackio_enabled off"
            )
        for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            if os.environ.get(var):
                raise RuntimeError(
                    f"{var} is set: trackio would send the run over the network; the sink "
                    "writes only the local store in the run directory. Unset it."
                )
        store.mkdir(parents=True, exist_ok=True)
        context = require("trackio.context_vars", "trackio", "the trackio sink")
        previous = context.current_run.get()
        try:
            self._run = trackio.init(
                project=project,
                name=run_name,
                config=config,
                resume="allow" if resume else "never",
                auto_log_gpu=False,
                auto_log_cpu=False,
                embed=False,
            )
        finally:
            context.current_run.set(previous)  # the caller's own trackio run stays current
        self.project = project
        self.run_name = run_name
        self.store = store
        self._closed = False

    def log(self, metrics: Metrics, step: int) -> None:
        """Log the scalars at ``step`` (tables stay in the expert-load store)."""
        scalars, _ = split_tables(metrics)
        if scalars:
            self._run.log(metrics={k: float(v) for k, v in scalars.items()}, step=int(step))

    def close(self) -> None:
        """Flush and finish the run; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._run.finish()
