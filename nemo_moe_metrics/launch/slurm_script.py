"""What the Slurm scripts (``recipes/slurm.py``, ``recipes/ray_slurm.py``) share around their job.

Both take a recipe and its overrides, print a dry run by default, submit with ``--submit``,
follow a job to its end with ``--wait`` or ``--follow JOB_ID``, and end every refusal or
failure in one line (status 2 for what the user can fix before submitting, 1 for what failed on
the cluster's side), never a traceback. A script gives its parser to :func:`add_job_flags` and
its own steps (dry run, submit, the line saying what was submitted) to :func:`run_job_script`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.launch.slurm_job import SlurmError, SubmittedJob, follow_job
from nemo_moe_metrics.runtime.extras import MissingExtraError, check_extra

#: Exit status of a refusal the user can fix before anything is submitted (as the CLI's).
USAGE = 2
#: Exit status of a failure on the cluster's side (sbatch refused, the job failed, ...).
FAILED = 1


def add_job_flags(parser: argparse.ArgumentParser, *, job_dir_help: str) -> None:
    """The flags every Slurm script has: recipe, overrides, output and job directories,
    ``--submit``, ``--wait`` and ``--follow`` (the run directory's ``--resume``/``--overwrite``
    are the CLI's own: ``nemo_moe_metrics.cli.add_run_dir_flags``)."""
    parser.add_argument("recipe", nargs="?", help="YAML recipe (not with --follow)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument(
        "--output-dir", default="runs", help="run directory root, on a filesystem nodes share"
    )
    parser.add_argument("--job-dir", default="slurm_jobs", help=job_dir_help)
    parser.add_argument("--submit", action="store_true", help="submit instead of a dry run")
    parser.add_argument(
        "--wait", action="store_true", help="with --submit: follow the job until it ends"
    )
    parser.add_argument(
        "--follow", metavar="JOB_ID", help="follow a job submitted earlier (same --job-dir)"
    )


def check_job_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (through ``parser.error``) flags that do not go together."""
    if args.follow:
        if args.recipe or args.submit:
            parser.error("--follow JOB_ID takes no recipe and no --submit")
    elif not (args.recipe and args.account and args.partition):
        parser.error("a recipe, --account and --partition are required (or --follow JOB_ID)")
    if (args.wait or args.resume or args.overwrite) and not args.submit:
        parser.error("--wait, --resume and --overwrite go with --submit")


def run_job_script(
    args: argparse.Namespace,
    *,
    script: str,
    dry_run: Callable[[], str],
    submit: Callable[[], SubmittedJob],
    submitted: Callable[[SubmittedJob], str],
    files_are: str,
) -> int:
    """Follow, print the dry run, or submit (and follow); the script's exit status.

    ``dry_run``, ``submit`` and ``submitted`` (the line naming a submitted job) are called only
    once the ``launch`` extra is known to be installed, so they may import what needs it;
    ``files_are`` names where the job's files are kept, for the error lines.
    """
    try:
        check_extra("launch", script)
        if args.follow:
            return follow_job(SubmittedJob.load(args.job_dir, args.follow))
        if args.nodes < 1 or args.gpus_per_node < 0 or (args.ranks_per_node or 1) < 1:
            raise ConfigError(
                f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: nodes must be at "
                "least 1, GPUs per node at least 0 (CPU nodes) and --ranks-per-node at least 1"
            )
        if not args.submit:
            print(dry_run())
            return 0
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "--submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node; "
                "without --submit this prints the sbatch command and script it would submit"
            )
        job = submit()
        print(*job.notes, submitted(job), sep="\n", flush=True)
        if not args.wait:
            print(f"follow it: python {script} --follow {job.job_id} --job-dir {args.job_dir}")
            return 0
        return follow_job(job)
    except (ConfigError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE
    except SlurmError as err:
        print(f"error: {err}; {files_are} are in {args.job_dir}/", file=sys.stderr)
        return FAILED
    except BrokenPipeError:  # `... --follow 12 | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # the cluster is unreachable, nemo-run failed to package, ...
        doing = (
            "following the job" if args.follow else "submitting to Slurm" if args.submit
            else "the dry run"
        )  # fmt: skip
        print(
            f"error: {doing} failed ({type(err).__name__}: {err}); {files_are} are in "
            f"{args.job_dir}/",
            file=sys.stderr,
        )
        return FAILED
