"""Slurm for real: a one-host controller with two node daemons (tests/support/slurm_cluster.py),
jobs submitted by recipes/slurm.py through nemo-run's SlurmExecutor on CPU with gloo, and compared
step for step with the same recipe run locally by ``nemo-moe-metrics run`` (the session's
main job). Without root or the Debian packages the cluster tests skip with the reason; CI sets
NEMO_MOE_METRICS_REQUIRE_SLURM=1 so that they fail instead (.ci/run installs Slurm)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from slurm_cluster import LocalSlurm

from nemo_moe_metrics.export import metric_names as names
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path
from nemo_moe_metrics.testing import free_port

# Slurm, nemo-run and the CLI: the same on every megatron-core line (tests/conftest.py).
pytestmark = [pytest.mark.one_line, pytest.mark.xdist_group("shared_runs")]

ROOT = Path(__file__).resolve().parents[2]

RECIPE = "examples/configs/grpo_moe_tiny.yaml"

STEPS = "training.max_steps=3"  # as the session's local main job (conftest.main_job_run)

CLUSTER = ("--account", "local", "--partition", "debug", "--gpus-per-node", "0")

# The jobs below, as docs/*/slurm.md shows them (paths and ports aside).
ONE_NODE = (RECIPE, STEPS, *CLUSTER, "--nodes", "1", "--ranks-per-node", "2")

TWO_NODES = (RECIPE, STEPS, *CLUSTER, "--nodes", "2", "--ranks-per-node", "1", "--launcher", "srun")

PREEMPT_STEPS = 4

PREEMPT = (RECIPE, f"training.max_steps={PREEMPT_STEPS}", *CLUSTER, "--nodes", "2")

PREEMPT += ("--ranks-per-node", "1")

# Values that depend on the wall clock; every other key must match the local run.
TIMED = {
    "train_perf/seconds",
    "train_perf/total_seconds",
    "train_perf/tokens_per_second",
    "train_perf/cumulative_tokens_per_second",
    "train_perf/estimated_flops_per_second",
    "train_perf/cumulative_estimated_flops_per_second",
    "train_perf/tflops_per_gpu",
    "train_perf/mfu",
}

REL = 1e-6  # the tolerance the local multi-rank tests use


def slurm_py(cluster: LocalSlurm, base: Path, *args, timeout: float = 400):
    (base / "home").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **cluster.env,
        "HOME": str(base / "home"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "120",
    }
    return subprocess.run(
        [sys.executable, "recipes/slurm.py", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        timeout=timeout,
    )  # fmt: skip


def _slurm_cmd(cluster: LocalSlurm, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), capture_output=True, text=True, env={**os.environ, **cluster.env}, timeout=60
    )


def _submitted_id(stdout: str) -> str:
    found = re.search(r"^submitted Slurm job (\d+): ", stdout, re.M)
    assert found, stdout
    return found[1]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _report_lines(text: str, run_dir: Path) -> list[str]:
    """The report's lines with the run directory as <run> and the wall-clock lines left out."""
    lines = text.replace(str(run_dir), "<run>").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run grpo_moe_tiny:"))
    timed = ("throughput:", "compute (last step):")
    return [line for line in lines[start:] if not line.startswith(timed)]


def _assert_same_run(job_dir: Path, local_dir: Path, job_stdout: str, tmp_path: Path) -> None:
    """metrics.jsonl, the expert-load store and the report equal the local run's, step by step."""
    from nemo_moe_metrics.report import render_report

    job, local = _rows(job_dir), _rows(local_dir)
    assert [r["step"] for r in job] == [r["step"] for r in local] == [0, 1, 2]
    for mine, theirs in zip(job, local, strict=True):
        assert set(mine) == set(theirs), set(mine) ^ set(theirs)
        compared = set(mine) - TIMED
        # The families that matter are among the compared keys, not only the timings.
        assert {
            "moe/load_balancing_loss",
            "moe/max_over_ideal",
            "moe/layer_3/max_over_ideal",
            "train/loss",
            "train/reward",
            "train_perf/tokens",
            "train_perf/estimated_flops",
        } <= compared
        for key in sorted(compared):
            if isinstance(theirs[key], float):
                assert mine[key] == pytest.approx(theirs[key], rel=REL, abs=1e-12), key
            else:
                assert mine[key] == theirs[key], key
    stored = list(read_expert_loads(store_path(job_dir)))
    expected = list(read_expert_loads(store_path(local_dir)))
    assert [s for s, _, _ in stored] == [s for s, _, _ in expected] == [0, 1, 2]
    for (_, ids, counts), (_, ids_ref, counts_ref) in zip(stored, expected, strict=True):
        assert np.array_equal(ids, ids_ref) and np.array_equal(counts, counts_ref)
    # The report the command printed is the local run's report (pictures drawn elsewhere).
    pictures = tmp_path / "local_pictures"
    local_report = render_report(local_dir, out_dir=pictures).replace(str(pictures), str(local_dir))
    assert _report_lines(job_stdout, job_dir) == _report_lines(local_report, local_dir)


# --------------------------------------------------------------------------- jobs


def _submit_and_wait(cluster: LocalSlurm, base: Path, job: tuple[str, ...]):
    proc = slurm_py(
        cluster, base, *job, "--rdzv-port", free_port(), "--output-dir", base / "runs",
        "--job-dir", base / "jobs", "--submit", "--wait",
    )  # fmt: skip
    return proc, base


@pytest.fixture(scope="module")
def one_node_job(slurm, tmp_path_factory):
    """1 node x 2 ranks under one torchrun (nemo-run's Torchrun launcher), followed to the end."""
    return _submit_and_wait(slurm, tmp_path_factory.mktemp("slurm_one_node"), ONE_NODE)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_node_torchrun_job_equals_the_local_run(one_node_job, main_job_run, tmp_path):
    proc, base = one_node_job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = _submitted_id(proc.stdout)
    assert f"job {job_id} (grpo_moe_tiny): RUNNING on n1\n" in proc.stdout
    assert f"job {job_id} (grpo_moe_tiny): COMPLETED, ExitCode 0:0" in proc.stdout
    assert "step 3/3  reward " in proc.stdout
    run_dir = base / "runs" / "grpo_moe_tiny"
    _assert_same_run(run_dir, main_job_run, proc.stdout, tmp_path)
    # Slurm's files stay in the job directory; the run directory is the local run's layout.
    assert (base / "jobs" / "submitted" / f"{job_id}.json").is_file()
    [task] = (base / "jobs" / "experiments" / "grpo_moe_tiny").glob("grpo_moe_tiny_*/train")
    assert (task / f"sbatch_grpo_moe_tiny_{job_id}.out").is_file()
    assert (task / f"log-grpo_moe_tiny_{job_id}_0.out").is_file()
    assert (task / "code" / "nemo_moe_metrics" / "train.py").is_file()
    assert not (base / "home" / ".nemo_run").exists()
    assert not [p for p in run_dir.iterdir() if "nemo_run" in p.name or "slurm" in p.name]


@pytest.fixture(scope="module")
def two_node_job(slurm, tmp_path_factory):
    """2 nodes x 1 rank, one Slurm task per rank (srun), rendezvous at the first node."""
    return _submit_and_wait(slurm, tmp_path_factory.mktemp("slurm_two_nodes"), TWO_NODES)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_srun_per_task_job_equals_the_local_run(
    slurm, two_node_job, main_job_run, tmp_path
):
    proc, base = two_node_job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = _submitted_id(proc.stdout)
    assert f"job {job_id} (grpo_moe_tiny): RUNNING on n[1-2]\n" in proc.stdout
    _assert_same_run(base / "runs" / "grpo_moe_tiny", main_job_run, proc.stdout, tmp_path)
    # Each rank was its own Slurm task, one per node daemon.
    [log] = (base / "jobs" / "experiments").rglob(f"log-grpo_moe_tiny_{job_id}_0.out")
    labels = {m[1] for m in re.finditer(r"^(\d+): ", log.read_text(), re.M)}
    assert labels == {"0", "1"}
    info = _slurm_cmd(slurm, "scontrol", "show", "job", "-o", job_id).stdout
    assert "NumNodes=2 " in info and "NumTasks=2 " in info


def _wait_for_lines(path: Path, count: int, timeout_s: float = 300) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().count("\n") >= count:
            return path.read_text().count("\n")
        time.sleep(0.2)
    raise AssertionError(f"{path}: fewer than {count} lines after {timeout_s} s")


def _wait_for_state(cluster: LocalSlurm, job_id: str, state: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        seen = _slurm_cmd(cluster, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
        if seen == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {state} after {timeout_s} s (last: {seen!r})")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_requeued_then_cancelled_job_resumes_with_every_step_once(slurm, tmp_path):
    # 2 nodes x 1 rank under torchrun (c10d rendezvous across the node daemons). Slurm
    # requeues it once (as after a preemption or a node failure: same job, restart 1), then
    # it is cancelled; `--resume` submits the rest.
    max_steps = PREEMPT_STEPS
    args = (
        *PREEMPT, "--rdzv-port", free_port(), "--output-dir", tmp_path / "runs", "--job-dir",
        tmp_path / "jobs",
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "grpo_moe_tiny"
    metrics = run_dir / "metrics.jsonl"
    proc = slurm_py(slurm, tmp_path, *args, "--submit")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = _submitted_id(proc.stdout)
    assert f"follow it: python recipes/slurm.py --follow {job_id} --job-dir " in proc.stdout

    logged = _wait_for_lines(metrics, 1)
    assert _slurm_cmd(slurm, "scontrol", "requeue", job_id).returncode == 0
    _wait_for_state(slurm, job_id, "PENDING")
    # A requeued job waits two minutes (BeginTime) before it may start again.
    assert (
        _slurm_cmd(slurm, "scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
    )
    _wait_for_lines(metrics, logged + 1)
    assert _slurm_cmd(slurm, "scancel", job_id).returncode == 0

    followed = slurm_py(slurm, tmp_path, "--follow", job_id, "--job-dir", tmp_path / "jobs")
    assert followed.returncode == 1, followed.stdout + followed.stderr
    assert f"job {job_id} (grpo_moe_tiny): CANCELLED, ExitCode 0:15: cancelled" in followed.stdout
    assert "plus --resume" in followed.stdout
    before = [r["step"] for r in _rows(run_dir)]
    assert before == list(range(len(before))) and len(before) < max_steps, before
    restart_log = next((tmp_path / "jobs").rglob(f"log-grpo_moe_tiny_{job_id}_1.out"))
    assert f"Slurm requeued job {job_id} (restart 1): continuing its run" in restart_log.read_text()

    resumed = slurm_py(slurm, tmp_path, *args, "--submit", "--resume", "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "COMPLETED, ExitCode 0:0" in resumed.stdout
    assert f"step {len(before) + 1}/{max_steps}  " in resumed.stdout  # only the new steps
    assert f"step {len(before)}/{max_steps}  " not in resumed.stdout

    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(max_steps))  # every step exactly once
    stored = [step for step, _, _ in read_expert_loads(store_path(run_dir))]
    assert stored == list(range(max_steps))
    # The token total went on across both restarts: the sum of each step's own tokens.
    running = np.cumsum([r[names.TOKENS] for r in rows])
    assert [r[names.TOTAL_TOKENS] for r in rows] == pytest.approx(running.tolist(), rel=1e-12)
    assert len(json.loads((run_dir / "run.json").read_text())["resumed"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failed_job_shows_its_state_exit_code_and_first_rank_error(slurm, tmp_path):
    # kv_channels=15: RoPE needs an even head dim; megatron-core fails in the first forward.
    proc = slurm_py(
        slurm, tmp_path, RECIPE, "training.max_steps=1", "policy.model.kv_channels=15",
        *CLUSTER, "--nodes", 1, "--ranks-per-node", 2, "--launcher", "srun", "--rdzv-port",
        free_port(), "--output-dir", tmp_path / "runs", "--job-dir", tmp_path / "jobs",
        "--submit", "--wait",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    job_id = _submitted_id(proc.stdout)
    assert re.search(rf"job {job_id} \(grpo_moe_tiny\): FAILED, ExitCode \d+:0: ", proc.stdout)
    assert re.search(
        r"^rank \d raised RuntimeError: The size of tensor a \(15\) must match the size of "
        r"tensor b \(16\)",
        proc.stdout,
        re.M,
    ), proc.stdout
    assert (
        "nemo_moe_metrics/algorithms/megatron_policy.py:" in proc.stdout
    )  # the frame in this library
    logs = dict(re.findall(r"^(rank log|batch log): (.+)$", proc.stdout, re.M))
    assert Path(logs["rank log"]).is_file() and Path(logs["batch log"]).is_file()
    assert "--resume" not in proc.stdout  # nothing was logged, so nothing to continue


# A line of `scontrol show job -o` from Slurm 22.05 (this controller), after scancel.
SCONTROL_LINE = (
    "JobId=3 JobName=grpo_moe_tiny UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901757 Nice=0 Account=local QOS=(null) JobState=CANCELLED Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 "
    "RunTime=00:00:09 TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-12-04T17:41:04 "
    "Partition=debug AllocNode:Sid=localhost:2885 ReqNodeList=(null) ExcNodeList=(null) "
    "NodeList=n[1-2] BatchHost=n1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* "
    "Command=/tmp/a dir/train_sbatch.sh WorkDir=/work/wt/35 StdOut=/tmp/a dir/x_3.out"
)


def test_scontrol_line_gives_state_exit_code_and_nodes():
    from nemo_moe_metrics.launch.slurm_job import job_info_from_scontrol, parse_scontrol_job

    fields = parse_scontrol_job(SCONTROL_LINE)
    assert fields["Command"] == "/tmp/a dir/train_sbatch.sh"  # values may hold spaces
    assert fields["ReqB:S:C:T"] == "0:0:*:*" and fields["Socks/Node"] == "*"
    info = job_info_from_scontrol(SCONTROL_LINE)
    assert (info.job_id, info.state, info.exit_code, info.signal) == ("3", "CANCELLED", 0, 15)
    assert (info.nodes, info.time_limit, info.reason, info.terminal) == (
        "n[1-2]",
        "01:00:00",
        None,
        True,
    )
    assert job_info_from_scontrol("slurm_load_jobs error: Invalid job id specified") is None


def test_sacct_line_gives_the_same_fields():
    from nemo_moe_metrics.launch.slurm_job import job_info_from_sacct

    text = "12|TIMEOUT|0:15|TimeLimit|gpu[01-02]|04:00:00\n12.batch|CANCELLED|0:15||gpu01|\n"
    info = job_info_from_sacct(text, "12")
    assert (info.state, info.exit_code, info.signal, info.nodes) == ("TIMEOUT", 0, 15, "gpu[01-02]")
    assert job_info_from_sacct("13|CANCELLED by 0|0:15|None|n1|UNLIMITED\n", "13").state == (
        "CANCELLED"
    )
    assert job_info_from_sacct(text, "99") is None


@pytest.mark.parametrize(
    "state, exit_code, reason, expected",
    [
        ("COMPLETED", "0:0", None, "COMPLETED, ExitCode 0:0: every rank finished"),
        ("CANCELLED", "0:15", None, "cancelled (scancel, or an administrator); ended by SIGTERM"),
        ("TIMEOUT", "0:15", "TimeLimit", "reached its time limit (04:00:00); ask for more with"),
        ("FAILED", "1:0", "NonZeroExitCode", "a rank exited 1: see the rank error below"),
        ("FAILED", "143:0", None, "ended by SIGTERM (exit 143): when one rank fails the others"),
        ("FAILED", "127:0", None, "a command was not found on the node (python or torchrun)"),
        ("FAILED", "0:53", "JobLaunchFailure", "the job directory (--job-dir) must be on a"),
        ("OUT_OF_MEMORY", "0:125", None, "ran out of host memory on a node"),
        ("NODE_FAIL", "0:0", "NodeDown", "one of its nodes failed (hardware or slurmd)"),
    ],
)
def test_exit_codes_are_explained(state, exit_code, reason, expected):
    from nemo_moe_metrics.launch.slurm_job import JobInfo, explain

    code, sig = map(int, exit_code.split(":"))
    info = JobInfo("12", state, code, sig, reason=reason, time_limit="04:00:00")
    text = explain(info)
    assert text.startswith(f"{state}, ExitCode {exit_code}: ") and expected in text, text
    assert "NonZeroExitCode" not in text  # the exit code already says it


def test_rank_comes_from_slurm_only_inside_an_srun_step():
    from nemo_moe_metrics.launch.slurm_job import SlurmError, rank_env_from_slurm

    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    assert rank_env_from_slurm(batch) == {}  # the batch script itself is no rank
    step = {**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    assert rank_env_from_slurm(step) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert rank_env_from_slurm({**step, "RANK": "1"}) == {}  # torchrun set it already
    bare = {k: v for k, v in step.items() if not k.startswith("MASTER_")}
    with pytest.raises(SlurmError, match="MASTER_ADDR and MASTER_PORT are not set"):
        rank_env_from_slurm(bare)
    one = {**bare, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert rank_env_from_slurm(one) == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def _page_commands(text: str) -> list[list[str]]:
    """recipes/slurm.py commands of a docs page, without paths and ports (as the tests vary)."""
    import shlex

    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.startswith("python recipes/slurm.py "):
            continue
        words = shlex.split(line.split("  #")[0], comments=True)[2:]
        kept, skip = [], False
        for word in words:
            if skip:
                skip = False
            elif word in ("--output-dir", "--job-dir", "--rdzv-port"):
                skip = True
            else:
                kept.append(word)
        commands.append(kept)
    return commands


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_slurm_page_shows_the_commands_these_tests_run(lang):
    commands = _page_commands((ROOT / "docs" / lang / "slurm.md").read_text(encoding="utf-8"))
    for args in (
        [*ONE_NODE, "--submit", "--wait"],
        [*TWO_NODES, "--submit", "--wait"],
        [*PREEMPT, "--submit"],
        [*PREEMPT, "--submit", "--resume", "--wait"],
    ):
        assert args in commands, " ".join(args)


@pytest.mark.slow
def test_a_job_slurm_has_forgotten_is_reported_from_its_batch_log(slurm, tmp_path, monkeypatch):
    # scontrol forgets a job MinJobAge seconds after it ends, and this controller has no
    # accounting (sacct: "Slurm accounting storage is disabled"): both are asked for real.
    import io

    from nemo_moe_metrics.launch.slurm_job import SubmittedJob, follow_job, query_job

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm.env["PATH"])
    sacct = _slurm_cmd(slurm, "sacct", "-j", "1")
    assert "accounting storage is disabled" in sacct.stdout + sacct.stderr
    assert query_job("999999") is None
    files = tmp_path / "train"
    files.mkdir()
    (files / "sbatch_grpo_moe_tiny_999999.out").write_text("+ echo\njob exited with code 1\n")
    job = SubmittedJob("999999", "grpo_moe_tiny", str(tmp_path / "run"), str(files), 3)
    out = io.StringIO()
    assert follow_job(job, out=out, poll_s=0.1) == 1
    text = out.getvalue()
    assert "job 999999 (grpo_moe_tiny): Slurm no longer knows it" in text
    assert "its batch log says: job exited with code 1" in text


def test_a_controller_that_does_not_answer_is_asked_again_not_taken_for_a_finished_job(tmp_path):
    # A real outage takes scontrol 18 s to report, so Slurm's answers are given here.
    import io

    from nemo_moe_metrics.launch.slurm_job import (
        JobInfo,
        SlurmError,
        SubmittedJob,
        follow_job,
        query_job,
    )

    def down(cmd, **kwargs):
        said = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
        return subprocess.CompletedProcess(cmd, 1, "", said)

    with pytest.raises(SlurmError, match=r"scontrol show job 7 failed: .*connect failure"):
        query_job("7", run=down)
    answers = [SlurmError("scontrol show job 7 failed: connect failure"), JobInfo("7", "COMPLETED")]

    def query(job_id):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    job = SubmittedJob("7", "grpo_moe_tiny", str(tmp_path / "run"), str(tmp_path), 3)
    out = io.StringIO()
    assert follow_job(job, out=out, poll_s=0.01, query=query, report=False) == 0
    text = out.getvalue()
    assert "connect failure; asking again every 0.01 s for 5 minutes" in text
    assert "job 7 (grpo_moe_tiny): COMPLETED, ExitCode 0:0" in text


def test_following_a_job_this_job_directory_never_submitted_names_the_ones_it_did(tmp_path):
    from nemo_moe_metrics.launch.slurm_job import SlurmError, SubmittedJob

    SubmittedJob("12", "grpo_moe_tiny", "/runs/grpo_moe_tiny", "/jobs/x/train", 8).save(tmp_path)
    assert SubmittedJob.load(tmp_path, "12").run_dir == "/runs/grpo_moe_tiny"
    with pytest.raises(
        SlurmError, match=r"no job 13 was submitted with --job-dir .*; jobs recorded there: 12$"
    ):
        SubmittedJob.load(tmp_path, "13")
