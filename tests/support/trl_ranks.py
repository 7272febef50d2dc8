"""One rank of tests/integrations/test_transformers.py's torchrun test: the example's SFT trainer
with the callback and the experts oracle; rank 0 writes the oracle summed over ranks and its log
history.

Rank 0 pauses after step 1 (writing ``paused`` with its pid) until the test writes ``go``: a
second training process is tried on the run directory meanwhile."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_tiny as tt  # noqa: E402

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.integrations.transformers import MoEMetricsCallback  # noqa: E402


class Pause(TrainerCallback):
    """On rank 0, after step 1: say so (with the pid), wait for the test's ``go``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1 or not state.is_world_process_zero:
            return
        (self.out / "paused").write_text(json.dumps({"pid": os.getpid()}), encoding="utf-8")
        deadline = time.monotonic() + 240
        while not (self.out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def main(out: Path) -> None:
    """Train 2 steps as one logging window; compare on rank 0."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    model_dir = tt.save_tiny_model(out / "model" / f"rank{rank}")
    callback = MoEMetricsCallback(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True),
        run_dir=out / "run",
        logger=LoggerConfig(table_every=1),  # as trl.md writes it: JSONL + store only
    )
    trainer = tt.build_trainer(
        "sft", model_dir, out / "trainer", [callback, Pause(out)], max_steps=2, logging_steps=2
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
