"""The old import path of :mod:`nemo_moe_metrics.launch.slurm_job` (a submitted Slurm job: its
state in plain words, the rank environment of one Slurm task per rank, a requeued job, following
a job to its end); everything is named there."""

from __future__ import annotations

from nemo_moe_metrics.launch.slurm_job import (
    SUBMITTED_DIR,
    UNREACHABLE_S,
    JobInfo,
    SlurmError,
    SubmittedJob,
    explain,
    follow_job,
    job_info_from_sacct,
    job_info_from_scontrol,
    parse_scontrol_job,
    query_job,
    rank_env_from_slurm,
    requeue_count,
)

__all__ = [
    "SUBMITTED_DIR",
    "UNREACHABLE_S",
    "JobInfo",
    "SlurmError",
    "SubmittedJob",
    "explain",
    "follow_job",
    "job_info_from_sacct",
    "job_info_from_scontrol",
    "parse_scontrol_job",
    "query_job",
    "rank_env_from_slurm",
    "requeue_count",
]
