"""SFT, DPO and GRPO loops over the reference Megatron policy worker, on synthetic data.

- :mod:`.sft`, :mod:`.dpo`, :mod:`.grpo`: the loops; :mod:`.common`: what they share;
- :mod:`.data`: the synthetic data that ships with the package;
- :mod:`.ranks`: the rank group the loops call (this SPMD rank's worker, or a Ray driver's
  worker group);
- :mod:`.megatron_policy`: the reference Megatron policy worker the loops train (megatron-core's
  schedule, the tiny recipe model of :mod:`nemo_moe_metrics.megatron.model`).
"""

from __future__ import annotations

from typing import Any

from nemo_moe_metrics.algorithms.common import LogFn
from nemo_moe_metrics.algorithms.dpo import run_dpo
from nemo_moe_metrics.algorithms.grpo import run_grpo
from nemo_moe_metrics.algorithms.sft import run_sft


def run_algorithm(recipe: Any, worker: Any, log_fn: LogFn, start_step: int = 0) -> None:
    """Run the loop the recipe's ``algorithm`` names, steps ``start_step .. max_steps - 1``.

    ``training.max_steps`` counts the whole run: a resumed run (``start_step`` > 0) trains the
    steps still missing; each step's synthetic batch depends only on (seed, step), so the data
    of a resumed run continues where the earlier process stopped."""
    loops = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo}
    loops[recipe.algorithm](recipe, worker, log_fn, start_step)


__all__ = ["LogFn", "run_algorithm"]
