"""SFT, DPO and GRPO loops over the reference Megatron policy worker, on synthetic data."""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.algorithms.common import LogFn


def run_algorithm(recipe: Any, worker: Any, log_fn: LogFn, start_step: int = 0) -> None:
    """Run the loop the recipe's ``algorithm`` names, steps ``start_step .. max_steps - 1``.

    ``training.max_steps`` counts the whole run: a resumed run (``start_step`` > 0) trains the
    steps still missing; each step's synthetic batch depends only on (seed, step), so the data
    of a resumed run continues where the earlier process stopped."""
    from nemo_moe_metrics.algorithms.dpo import run_dpo
    from nemo_moe_metrics.algorithms.grpo import run_grpo
    from nemo_moe_metrics.algorithms.sft import run_sft

    loops = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}
    loops[recipe.algorithm](recipe, worker, log_fn, start_step)


__all__ = ["LogFn", "run_algorithm"]
