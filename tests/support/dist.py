"""Multi-process test helpers (re-exported from the package, shared with the benchmarks)."""

from nemo_moe_metrics.testing import free_port, ok_values, run_ranks

__all__ = ["free_port", "ok_values", "run_ranks"]
