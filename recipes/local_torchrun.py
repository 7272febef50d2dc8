"""Launch a recipe on local torchrun ranks through nemo-run (CPU with gloo, or local GPUs).

    python recipes/local_torchrun.py examples/configs/grpo_moe_tiny.yaml --nproc 2 \
        policy.megatron_cfg.moe_per_layer_logging=true

Same as ``nemo-moe-metrics run`` without the progress bar: nemo-run's own console output.
The run lands in ``<output-dir>/<recipe name>/`` (``metrics.jsonl``, ``recipe.yaml``, and
nemo-run's state under ``nemo_run/``, so nothing is written to the home directory).
"""

from __future__ import annotations

import argparse
import sys

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.launch import launch_local


def main() -> int:
    """Parse the command line and launch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--output-dir", default="runs", help="default runs/")
    args = parser.parse_args()
    try:
        run_dir = launch_local(args.recipe, args.overrides, args.nproc, args.output_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
