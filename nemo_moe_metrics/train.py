"""Per-rank training entrypoint: ``python -m nemo_moe_metrics.train --recipe R --output-dir D``.

torchrun (through nemo-run, see :mod:`nemo_moe_metrics.launch`) starts one of these per rank.
Every rank builds the policy worker and runs the recipe's loop; rank 0 writes
``D/metrics.jsonl`` (one JSON object per step, flushed each step) and ``D/recipe.yaml``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from nemo_moe_metrics.config import ConfigError, Recipe, dump_recipe, load_recipe

METRICS_FILE = "metrics.jsonl"


def to_jsonable(value: Any) -> Any:
    """Plain JSON values from tensors, numpy scalars and nested containers; NaN/inf -> None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif hasattr(value, "item") and callable(value.item) and not isinstance(value, (list, dict)):
        value = value.item()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    """A minimal ``log(metrics, step)`` / ``close()`` sink: one JSON line per step, flushed."""

    def __init__(self, path: str | Path) -> None:
        """Open ``path`` for writing (truncating), creating its folder."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``{"step": step, **metrics}`` and flush, so a tailing reader sees it now."""
        self._file.write(json.dumps({"step": step, **to_jsonable(metrics)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class NullWriter:
    """The sink of ranks other than 0: logs nothing."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


def make_hooks(recipe: Recipe) -> Any | None:
    """The metrics hooks for the worker (the metrics integration plugs in here); None = none."""
    return None


def train(recipe: Recipe, output_dir: str | Path) -> None:
    """Build the worker, run the recipe's loop, write the run directory on rank 0."""
    import torch.distributed as dist

    from nemo_moe_metrics.algorithms import run_algorithm
    from nemo_moe_metrics.megatron.policy import MegatronPolicyWorker

    output_dir = Path(output_dir)
    worker = MegatronPolicyWorker(recipe, hooks=make_hooks(recipe))
    rank = dist.get_rank()
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    writer = (
        JsonlWriter(output_dir / METRICS_FILE)
        if rank == 0 and recipe.logger.jsonl_enabled
        else NullWriter()
    )
    try:
        run_algorithm(recipe, worker, writer.log)
    finally:
        writer.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the per-rank entrypoint."""
    parser = argparse.ArgumentParser(prog="python -m nemo_moe_metrics.train")
    parser.add_argument("--recipe", required=True, help="YAML recipe")
    parser.add_argument("--output-dir", required=True, help="run directory (rank 0 writes here)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; a configuration error prints one line and exits with status 2."""
    args = build_parser().parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Two CPU ranks on two cores: more intra-op threads per rank only oversubscribe.
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    train(recipe, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
