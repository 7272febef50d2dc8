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
import sys

from nemo_moe_metrics.cli import add_run_dir_flags
from nemo_moe_metrics.launch.slurm_script import add_job_flags, check_job_flags, run_job_script

SCRIPT = "recipes/slurm.py"


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    add_job_flags(
        parser,
        job_dir_help="where nemo-run keeps the sbatch script, logs and packaged code "
        "(default slurm_jobs/)",
    )
    add_run_dir_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; print the dry run, submit, or follow a job."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after options
    check_job_flags(parser, args)
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

    def dry_run() -> str:
        from nemo_moe_metrics.launch import slurm_dry_run  # needs the launch extra (nemo-run)

        return slurm_dry_run(args.recipe, args.overrides, args.output_dir, **kwargs)

    def submit():
        from nemo_moe_metrics.launch import slurm_submit

        return slurm_submit(
            args.recipe, args.overrides, args.output_dir,
            resume=args.resume, overwrite=args.overwrite, **kwargs,
        )  # fmt: skip

    def submitted(job) -> str:
        per_node = f"{job.ranks_per_node} rank{'s' if job.ranks_per_node > 1 else ''}"
        return (
            f"submitted Slurm job {job.job_id}: {job.name} on {job.nodes} node(s) x {per_node} "
            f"({job.launcher})\nrun directory: {job.run_dir}\njob files: {job.job_files}"
        )

    return run_job_script(
        args, script=SCRIPT, dry_run=dry_run, submit=submit, submitted=submitted,
        files_are="nemo-run's files",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
