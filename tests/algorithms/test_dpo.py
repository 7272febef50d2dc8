"""DPO's checks before training (algorithms/dpo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_dpo_rejects_odd_micro_batch_before_training():
    from nemo_moe_metrics.algorithms.dpo import run_dpo
    from nemo_moe_metrics.config import load_recipe

    recipe = load_recipe(
        CONFIGS / "dpo_moe_tiny.yaml",
        ["policy.train_micro_batch_size=1", "policy.train_global_batch_size=8"],
    )
    with pytest.raises(ValueError, match="must both be even"):
        run_dpo(recipe, worker=None, log_fn=print)
