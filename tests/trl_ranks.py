"""One rank of tests/test_trl.py's torchrun test: the example's SFT trainer with the callback
and the experts oracle; rank 0 writes the oracle summed over ranks and its log history."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_tiny as tt  # noqa: E402

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback  # noqa: E402


def main(out: Path) -> None:
    """Train 2 steps as one logging window; compare on rank 0."""
    import os

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    model_dir = tt.save_tiny_model(out / "model" / f"rank{rank}")
    callback = MoEMetricsCallback(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True),
        run_dir=out / "run",
        logger=LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
    )
    trainer = tt.build_trainer(
        "sft", model_dir, out / "trainer", [callback], max_steps=2, logging_steps=2
    )
    oracle = tt.ExpertsOracle(trainer.model, 4)
    trainer.train()
    counts = torch.stack([oracle.train[layer] for layer in range(2)])
    dist.all_reduce(counts)  # the trainer's gloo group, still up after train()
    if rank == 0:
        history = [h for h in trainer.state.log_history if "loss" in h]
        result = {
            "oracle": counts.tolist(),
            "logged": tt.logged_counts(callback.last_metrics, 2, 4),
            "history": history,
            "world": dist.get_world_size(),
        }
        (out / "result.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
