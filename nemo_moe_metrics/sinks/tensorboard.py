"""TensorBoard sink: scalars only; tables never become one series per expert."""

from __future__ import annotations

from pathlib import Path

from nemo_moe_metrics.sinks.base import Metrics, split_tables


class TensorBoardSink:
    """Write every scalar metric with ``add_scalar``; flush each step so a crash loses nothing."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; events at or after it that an earlier
        process wrote are hidden, so a step is never shown twice."""
        # Imported here: torch.utils.tensorboard pulls in tensorboard, which is slow to import.
        from nemo_moe_metrics.extras import check_extra

        check_extra("tensorboard", "the TensorBoard sink (logger.tensorboard_enabled)")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def wants_tables(self, step: int) -> bool:
        """Never: TensorBoard gets scalars only."""
        return False

    def log(self, metrics: Metrics, step: int) -> None:
        """Add one point per scalar key; skip tables (they live in the store and W&B)."""
        scalars, _ = split_tables(metrics)
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
