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
        "--output-dir", default="runs", help="run directory root, on a filesystem nodes share"
    )
    parser.add_argument(
        "--job-dir", default="slurm_jobs", help="the job's script and logs (default slurm_jobs/)"
    )
    parser.add_argument(
        "--nemo-run",
        action="store_true",
        help="print nemo-run's Ray-on-Slurm script (pyxis containers) instead; dry run only",
    )
    parser.add_argument("--container-image", default=None, help="with --nemo-run")
    parser.add_argument("--submit", action="store_true", help="submit instead of a dry run")
    parser.add_argument(
        "--wait", action="store_true", help="with --submit: follow the job until it ends"
    )
    parser.add_argument("--follow", metavar="JOB_ID", help="follow a job submitted earlier")
    add_run_dir_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; print the dry run, submit, or follow a job."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if args.follow:
        if args.recipe or args.submit:
            parser.error("--follow JOB_ID takes no recipe and no --submit")
    elif not (args.recipe and args.account and args.partition):
        parser.error("a recipe, --account and --partition are required (or --follow JOB_ID)")
    if (args.wait or args.resume or args.overwrite) and not args.submit:
        parser.error("--wait, --resume and --overwrite go with --submit")
    if args.nemo_run and (args.submit or not args.container_image):
        parser.error("--nemo-run prints nemo-run's script for a container cluster: give "
                     "--container-image IMAGE, and submit it with nemo-run (no --submit here)")  # fmt: skip
    try:
        check_extra("launch", "recipes/ray_slurm.py")
        from nemo_moe_metrics.launch.ray_slurm import (
            nemo_run_ray_dry_run,
            ray_dry_run,
            submit_ray_job,
        )
        from nemo_moe_metrics.launch.slurm_job import SubmittedJob, follow_job

        if args.follow:
            return follow_job(SubmittedJob.load(args.job_dir, args.follow))
        if args.nodes < 1 or args.gpus_per_node < 0 or (args.ranks_per_node or 1) < 1:
            raise ConfigError(
                f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: nodes must be at "
                "least 1, GPUs per node at least 0 (CPU nodes) and --ranks-per-node at least 1"
            )
        common = dict(account=args.account, partition=args.partition, nodes=args.nodes)
        common.update(gpus_per_node=args.gpus_per_node, time_limit=args.time)
        if args.nemo_run:
            print(
                nemo_run_ray_dry_run(
                    args.recipe, args.overrides, args.output_dir, job_dir=args.job_dir,
                    container_image=args.container_image, **common,
                )
            )  # fmt: skip
            return 0
        common.update(ranks_per_node=args.ranks_per_node, ray_port=args.ray_port)
        if not args.submit:
            print(ray_dry_run(args.recipe, args.overrides, args.output_dir, job_dir=args.job_dir,
                              **common))  # fmt: skip
            return 0
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "--submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node; "
                "without --submit this prints the sbatch script it would submit"
            )
        job = submit_ray_job(
            args.recipe, args.overrides, args.output_dir, job_dir=args.job_dir,
            resume=args.resume, overwrite=args.overwrite, **common,
        )  # fmt: skip
        print(
            f"submitted Slurm job {job.job_id}: {job.name} with Ray on {job.nodes} node(s) x "
            f"{job.ranks_per_node} rank(s)\nrun directory: {job.run_dir}\njob files: "
            f"{job.job_files}",
            flush=True,
        )
        if not args.wait:
            print(
                f"follow it: python recipes/ray_slurm.py --follow {job.job_id} --job-dir "
                f"{args.job_dir}"
            )
            return 0
        return follow_job(job)
    except (ConfigError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SlurmError as err:
        print(f"error: {err}; the job's files are in {args.job_dir}/", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `... --follow 12 | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
