"""Launch a recipe on a Slurm GPU cluster through nemo-run (one torchrun per node).

Show what would be submitted (the default, works anywhere):

    python recipes/slurm.py examples/configs/grpo_moe_tiny.yaml \
        --account ACCOUNT --partition PARTITION --nodes 2 --gpus-per-node 8 \
        --container-image nvcr.io/nvidia/nemo:25.09

The dry run prints the ``sbatch`` command and script (long commands folded) and writes nothing.
Add ``--submit`` on a Slurm login node to submit it; nemo-run keeps its files in ``--job-dir``
(default ``slurm_jobs/``), never in a run directory. The job is named after the recipe.
The code is packaged from the git repository and mounted at the container's working
directory, so the recipe path and ``--output-dir`` are read relative to the repository root
on the cluster. On GPUs the worker
uses NCCL, the alltoall token dispatcher, and no CPU shims.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.extras import MissingExtraError, check_extra


def main() -> int:
    """Parse the command line; print the dry run or submit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="YAML recipe, relative to the repository root")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--account", required=True)
    parser.add_argument("--partition", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--time", default="01:00:00")
    parser.add_argument("--container-image", default=None)
    parser.add_argument("--output-dir", default="runs", help="run directory root on the cluster")
    parser.add_argument(
        "--job-dir",
        default="slurm_jobs",
        help="where nemo-run keeps the sbatch script, logs and packaged code (default slurm_jobs/)",
    )
    parser.add_argument("--submit", action="store_true", help="submit instead of a dry run")
    args = parser.parse_intermixed_args()  # overrides may come before or after options
    kwargs = dict(
        account=args.account,
        partition=args.partition,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        container_image=args.container_image,
        job_dir=args.job_dir,
    )
    try:
        check_extra("launch", "recipes/slurm.py")
        from nemo_moe_metrics.launch import slurm_dry_run, slurm_submit

        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ConfigError(
                f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: both must be at "
                "least 1"
            )
        if not args.submit:
            print(slurm_dry_run(args.recipe, args.overrides, args.output_dir, **kwargs))
            return 0
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "--submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node; "
                "without --submit this prints the sbatch command and script it would submit"
            )
        slurm_submit(args.recipe, args.overrides, args.output_dir, **kwargs)
    except (ConfigError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # sbatch refused the job, the cluster is unreachable, ...
        print(
            f"error: submitting to Slurm failed ({type(err).__name__}: {err}); "
            f"nemo-run's files are in {args.job_dir}/",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
