"""Launching a recipe: local torchrun ranks through nemo-run, the ``run`` supervisor, Slurm.

- :mod:`.checks`: what is checked before any process starts, and claiming the run directory.
- :mod:`.local`: the nemo-run local launch (``python -m nemo_moe_metrics.launch``).
- :mod:`.supervise`: ``nemo-moe-metrics run``: the console supervisor and the child's signals.
- :mod:`.job_watch`: stopped ranks and launchers, found while the job runs.
- :mod:`.progress`: the progress line read from ``metrics.jsonl``.
- :mod:`.failure_report`: what a failed run prints.
- :mod:`.slurm_submit`: the Slurm executor, dry run and submission; :mod:`.slurm_job`: a
  submitted job's state, its ranks' environment and following it to its end.

The names below are the package's public ones (``from nemo_moe_metrics.launch import ...``
keeps working as it did when this was one module).
"""

from __future__ import annotations

from nemo_moe_metrics.launch.checks import (
    check_launch_extras,
    check_resume_has_steps_left,
    claim_run_dir,
    run_dir_for,
)
from nemo_moe_metrics.launch.failure_report import failure_report
from nemo_moe_metrics.launch.failures import first_rank_failure
from nemo_moe_metrics.launch.local import (
    launch_local,
    local_executor,
    main,
    train_script,
    use_nemorun_home,
)
from nemo_moe_metrics.launch.progress import (
    GRPO_FIELDS,
    GRPO_LOSS_NOTE,
    PIPED_WIDTH,
    PROGRESS_FIELDS,
    describe_step,
    read_new_lines,
)
from nemo_moe_metrics.launch.slurm_submit import (
    LAUNCHERS,
    fold_shell_line,
    slurm_dry_run,
    slurm_executor,
    slurm_submit,
)
from nemo_moe_metrics.launch.supervise import run_with_progress
from nemo_moe_metrics.run_dir.names import LAUNCH_LOG, NEMORUN_DIR
from nemo_moe_metrics.run_dir.record import prepare_run_dir

__all__ = [
    "GRPO_FIELDS",
    "GRPO_LOSS_NOTE",
    "LAUNCHERS",
    "LAUNCH_LOG",
    "NEMORUN_DIR",
    "PIPED_WIDTH",
    "PROGRESS_FIELDS",
    "check_launch_extras",
    "check_resume_has_steps_left",
    "claim_run_dir",
    "describe_step",
    "failure_report",
    "first_rank_failure",
    "fold_shell_line",
    "launch_local",
    "local_executor",
    "main",
    "prepare_run_dir",
    "read_new_lines",
    "run_dir_for",
    "run_with_progress",
    "slurm_dry_run",
    "slurm_executor",
    "slurm_submit",
    "train_script",
    "use_nemorun_home",
]
