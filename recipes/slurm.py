"""Launch a recipe on a Slurm cluster through nemo-run (one torchrun per node, or srun per rank).

Show what would be submitted (the default, works anywhere):

    python recipes/slurm.py examples/configs/grpo_moe_tiny.yaml \
        --account ACCOUNT --partition PARTITION --nodes 2 --gpus-per-node 8 \
        --container-image nvcr.io/nvidia/nemo:25.09

The dry run prints the ``sbatch`` command and script (long commands folded) and writes nothing.
Add ``--submit`` on a Slurm login node to submit it (``--wait`` to follow it to the end: its
state, its steps, then the report or the first rank error); ``--follow JOB_ID`` follows a job
submitted earlier. nemo-run keeps its files in ``--job-dir`` (default ``slurm_jobs/``), never in
a run directory. The job is named after the recipe. The code is the git repository this runs
in, packaged at HEAD; the recipe is read relative to its root (or at its absolute path when it
lies outside). ``--output-dir`` is resolved here: it must be on a filesystem the compute nodes
share, and ``--resume`` continues the run there (a preempted or cancelled job). On GPUs the
worker uses NCCL, the alltoall token dispatcher, and no CPU shims; ``--gpus-per-node 0
--ranks-per-node N`` runs CPU ranks with gloo. docs/en/slurm.md walks through it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from nemo_moe_metrics.cli import add_run_dir_flags
from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.launch.slurm_job import SlurmError
from nemo_moe_metrics.runtime.extras import MissingExtraError, check_extra


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", help="YAML recipe (not with --follow)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--account")
    parser.add_argument("--partition")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node (0: CPU nodes, gloo)"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node (default: one per GPU; needed with --gpus-per-node 0)",
    )
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "srun"),
        default="torchrun",
        help="torchrun: one torchrun per node starts its ranks (default); srun: one Slurm task "
        "per rank",
    )
    parser.add_argument(
        "--rdzv-port", type=int, default=29500, help="rendezvous port on the first node"
    )
    parser.add_argument("--time", default="01:00:00")
    parser.add_argument("--container-image", default=None)
    parser.add_argument(
        "--output-dir", default="runs", help="run directory root, on a filesystem nodes share"
    )
    parser.add_argument(
        "--job-dir",
        default="slurm_jobs",
        help="where nemo-run keeps the sbatch script, logs and packaged code (default slurm_jobs/)",
    )
    parser.add_argument("--submit", action="store_true", help="submit instead of a dry run")
    parser.add_argument(
        "--wait", action="store_true", help="with --submit: follow the job until it ends"
    )
    parser.add_argument(
        "--follow", metavar="JOB_ID", help="follow a job submitted earlier (same --job-dir)"
    )
    add_run_dir_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; print the dry run, submit, or follow a job."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    if args.follow:
        if args.recipe or args.submit:
            parser.error("--follow JOB_ID takes no recipe and no --submit")
    elif not (args.recipe and args.account and args.partition):
        parser.error("a recipe, --account and --partition are required (or --follow JOB_ID)")
    if (args.wait or args.resume or args.overwrite) and not args.submit:
        parser.error("--wait, --resume and --overwrite go with --submit")
    kwargs = dict(
        account=args.account,
        partition=args.partition,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        ranks_per_node=args.ranks_per_node,
        launcher=args.launcher,
        rdzv_port=args.rdzv_port,
        time=args.time,
        container_image=args.container_image,
        job_dir=args.job_dir,
    )
    try:
        check_extra("launch", "recipes/slurm.py")
        from nemo_moe_metrics.launch import slurm_dry_run, slurm_submit
        from nemo_moe_metrics.launch.slurm_job import SubmittedJob, follow_job

        if args.follow:
            return follow_job(SubmittedJob.load(args.job_dir, args.follow))
        if args.nodes < 1 or args.gpus_per_node < 0 or (args.ranks_per_node or 1) < 1:
            raise ConfigError(
                f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: nodes must be at "
                "least 1, GPUs per node at least 0 (CPU nodes) and --ranks-per-node at least 1"
            )
        if not args.submit:
            print(slurm_dry_run(args.recipe, args.overrides, args.output_dir, **kwargs))
            return 0
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "--submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node; "
                "without --submit this prints the sbatch command and script it would submit"
            )
        job = slurm_submit(
            args.recipe,
            args.overrides,
            args.output_dir,
            resume=args.resume,
            overwrite=args.overwrite,
            **kwargs,
        )
        per_node = f"{job.ranks_per_node} rank{'s' if job.ranks_per_node > 1 else ''}"
        print(
            *job.notes,
            f"submitted Slurm job {job.job_id}: {job.name} on {job.nodes} node(s) x {per_node} "
            f"({job.launcher})\nrun directory: {job.run_dir}\njob files: {job.job_files}",
            sep="\n",
            flush=True,
        )
        if not args.wait:
            print(
                f"follow it: python recipes/slurm.py --follow {job.job_id} --job-dir {args.job_dir}"
            )
            return 0
        return follow_job(job)
    except (ConfigError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SlurmError as err:
        print(f"error: {err}; nemo-run's files are in {args.job_dir}/", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `... --follow 12 | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # the cluster is unreachable, nemo-run failed to package, ...
        doing = "following the job" if args.follow else "submitting to Slurm"
        print(
            f"error: {doing} failed ({type(err).__name__}: {err}); "
            f"nemo-run's files are in {args.job_dir}/",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
