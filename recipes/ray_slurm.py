"""Run a recipe with the Ray engine on Slurm: a Ray head, Ray workers, then the driver.

Show what would be submitted (the default, works anywhere):

    python recipes/ray_slurm.py examples/configs/grpo_moe_tiny.yaml \
        --account ACCOUNT --partition PARTITION --nodes 2 --gpus-per-node 8

The job starts Ray the way NeMo RL users do (its ``ray.sub``): ``ray start --head`` on the
allocation's first node and ``ray start --address`` on the others, each through ``srun``, then
runs the driver (``python -m nemo_moe_metrics.launch.ray_driver``) on the first node; the
driver's actors are the ranks (one per GPU, or ``--gpus-per-node 0 --ranks-per-node N`` CPU
ranks per node with gloo). The nodes run this checkout and this Python environment, so both
must be on a filesystem they share, as ``--output-dir`` must. ``--submit`` submits it
(``--wait`` follows it to its end and prints the report); ``--follow JOB_ID`` follows a job
submitted earlier. On a cluster with pyxis containers, ``--nemo-run --container-image IMAGE``
prints nemo-run's own Ray-on-Slurm script (``RayJob``) for the same driver instead: every Ray
process in a container. docs/en/ray.md says which to use when.
"""

from __future__ import annotations

import argparse
import sys

from nemo_moe_metrics.cli import add_run_dir_flags
from nemo_moe_metrics.launch.slurm_script import add_job_flags, check_job_flags, run_job_script

SCRIPT = "recipes/ray_slurm.py"


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--account")
    parser.add_argument("--partition")
    parser.add_argument("--nodes", type=int, default=2, help="Slurm nodes: one Ray node each")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node (0: CPU nodes, gloo)"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="Ray actors per node (default: one per GPU; needed with --gpus-per-node 0)",
    )
    parser.add_argument("--ray-port", type=int, default=6379, help="the Ray head's port")
    parser.add_argument("--time", default="01:00:00")
    parser.add_argument(
        "--nemo-run",
        action="store_true",
        help="print nemo-run's Ray-on-Slurm script (pyxis containers) instead; dry run only",
    )
    parser.add_argument("--container-image", default=None, help="with --nemo-run")
    add_job_flags(parser, job_dir_help="the job's script and logs (default slurm_jobs/)")
    add_run_dir_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; print the dry run, submit, or follow a job."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    check_job_flags(parser, args)
    if args.nemo_run and (args.submit or not args.container_image):
        parser.error(
            "--nemo-run prints nemo-run's script for a container cluster: give "
            "--container-image IMAGE, and submit it with nemo-run (no --submit here)"
        )
    common = dict(account=args.account, partition=args.partition, nodes=args.nodes)
    common.update(gpus_per_node=args.gpus_per_node, time_limit=args.time, job_dir=args.job_dir)

    def dry_run() -> str:
        # needs the launch extra (nemo-run)
        from nemo_moe_metrics.launch.ray_slurm import nemo_run_ray_dry_run, ray_dry_run

        if args.nemo_run:
            return nemo_run_ray_dry_run(
                args.recipe, args.overrides, args.output_dir,
                container_image=args.container_image, **common,
            )  # fmt: skip
        return ray_dry_run(
            args.recipe, args.overrides, args.output_dir,
            ranks_per_node=args.ranks_per_node, ray_port=args.ray_port, **common,
        )  # fmt: skip

    def submit():
        from nemo_moe_metrics.launch.ray_slurm import submit_ray_job

        return submit_ray_job(
            args.recipe, args.overrides, args.output_dir, resume=args.resume,
            overwrite=args.overwrite, ranks_per_node=args.ranks_per_node,
            ray_port=args.ray_port, **common,
        )  # fmt: skip

    def submitted(job) -> str:
        return (
            f"submitted Slurm job {job.job_id}: {job.name} with Ray on {job.nodes} node(s) x "
            f"{job.ranks_per_node} rank(s)\nrun directory: {job.run_dir}\njob files: "
            f"{job.job_files}"
        )

    return run_job_script(
        args, script=SCRIPT, dry_run=dry_run, submit=submit, submitted=submitted,
        files_are="the job's files",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
