"""The progress line run prints from metrics.jsonl (launch/progress.py)."""

from __future__ import annotations

# --------------------------------------------------------------------------- 11. GRPO progress


def test_grpo_progress_text_puts_reward_first_and_labels_the_loss():
    from nemo_moe_metrics.launch import GRPO_LOSS_NOTE, describe_step

    row = {"step": 3, "train/loss": 0.0, "train/reward": 0.3125, "moe/max_over_ideal": 1.5}
    assert describe_step(row, "grpo") == "reward 0.312  pg-loss 0.0000  max/ideal 1.50"
    assert describe_step(row, "sft") == "loss 0.0000  reward 0.312  max/ideal 1.50"
    assert "about 0 on-policy" in GRPO_LOSS_NOTE and "gradient is not 0" in GRPO_LOSS_NOTE
