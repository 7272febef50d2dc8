"""Faults a cluster injects, through the real CLI: every step exactly once, or a refusal that
names the cause.

One chain of real ``nemo-moe-metrics run`` jobs (2 torchrun ranks, the tiny SFT recipe, W&B
off) on a small real file system (a tmpfs; root only, else a temporary folder and the full-disk
steps skip), with faults of ``benchmarks/fault_injection.py``:

1. a fresh run; while it trains, a second ``run``, a ``--resume`` and an ``--overwrite`` of the
   same directory are refused naming it; then Ctrl-C (SIGINT to its process group);
2. ``--resume``; ``kill -9`` of ``run`` itself;
3. ``--resume``; ``kill -9`` of rank 1;
4. three ``--resume`` rounds with the faults that make no Python error, each named by what
   happened: a stopped rank (named while the others wait for it), torchrun killed (its ranks'
   last words from torchelastic's log), a stopped torchrun (a timeout, then the job is
   stopped);
5. what ``--resume`` does before it trains (API), a last ``--resume`` that trains to the end,
   then the pictures of ``report`` on a full disk.

A whole job on a full disk runs in the slow mode (``--disk-full``); here the sinks on a full
tmpfs and what ``run`` prints then are tested without ranks.

Then every step must be in metrics.jsonl, the store and TensorBoard exactly once. The slow mode
(N >= 10 random faults): ``python benchmarks/fault_injection.py --rounds 12``.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import fault_injection as fi  # noqa: E402

pytestmark = [
    pytest.mark.one_line,
    pytest.mark.xdist_group("faults"),
]  # CLI behaviour: the same on both megatron-core lines

STEP_BATCH = 1  # logged steps to wait for before each fault
#: faults of benchmarks/fault_injection.py that make no Python error: a stopped rank (named
#: while the others wait for it), torchrun killed (its ranks' last words from torchelastic's
#: log), a stopped torchrun (a timeout, then the job is stopped)
NAMED_FAULTS = ("stop-rank", "kill-torchrun", "stop-launcher")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout,
    )  # fmt: skip


def _round(out: Path, fault, *, max_steps: int = 200) -> dict:
    """Resume (or start) the run, wait for STEP_BATCH more steps, do ``fault(job)``; what the
    run then said and did."""
    run_dir = out / fi.NAME
    before = len(fi.logged(run_dir))
    job = fi.Job(out, max_steps, resume=before > 0)
    reached = fi.wait_for_steps(job, run_dir, before + STEP_BATCH)
    assert reached >= before + STEP_BATCH, job.output(timeout=60)[1]
    job.pids()
    seen = {"job": job, "extra": fault(job)}
    seen["status"], seen["said"] = job.output(timeout=180)
    seen["gone_s"], seen["left"] = job.wait_gone(timeout=20)
    return seen


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    with fi.small_filesystem(96) as small:
        out = small or tmp_path_factory.mktemp("runs")
        rounds: dict[str, dict] = {"dir": out / fi.NAME}

        def refuse_then_interrupt(job):
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                refusals = list(
                    pool.map(
                        lambda flags: _cli(
                            "run", str(fi.RECIPE), *fi.OVERRIDES, *flags, "--output-dir", str(out)
                        ),  # fmt: skip
                        ([], ["--resume"], ["--overwrite"]),
                    )
                )
            os.killpg(job.proc.pid, fi.signal.SIGINT)  # what Ctrl-C in its terminal sends
            return refusals

        rounds["sigint"] = _round(out, refuse_then_interrupt)
        rounds["kill-run"] = _round(out, lambda job: os.kill(job.proc.pid, fi.signal.SIGKILL))

        def kill_rank_1(job):
            rank1 = job.ranks()[1]
            os.kill(rank1, fi.signal.SIGKILL)
            return rank1

        rounds["kill-rank"] = _round(out, kill_rank_1)
        for fault in NAMED_FAULTS:
            rounds[fault] = _round(out, lambda job, f=fault: fi.inject(job, f, random.Random(0)))
        rounds["final"] = _as_a_resume_leaves_it(out / fi.NAME)
        last = fi.Job(out, rounds["final"]["max_steps"] + 2, resume=True)
        rounds["resumed"] = {"status": last.output(timeout=240)[0]}
        rounds["resumed"]["steps"] = fi.sink_steps(out / fi.NAME)
        rounds["resumed"]["recipe"] = (out / fi.NAME / "recipe.yaml").read_text()
        rounds["report"] = _report_on_a_full_disk(out / fi.NAME) if small is not None else None
        yield rounds


def _as_a_resume_leaves_it(run_dir: Path) -> dict:
    """What ``--resume`` does before it trains (rounds 2 and 3 did it through the CLI, after
    the faults before them): the records are made to agree, and TensorBoard hides events an
    earlier process wrote ahead. Then every sink's steps."""
    from nemo_moe_metrics.config import load_recipe
    from nemo_moe_metrics.sinks import build_sinks

    recipe = load_recipe(fi.RECIPE, [*fi.OVERRIDES, "logger.resume=true"])
    build_sinks(recipe.logger, run_dir, run_name=recipe.name).close()
    logged = fi.logged(run_dir)
    return {"max_steps": max(logged) + 1, "steps": fi.sink_steps(run_dir)}


def _report_on_a_full_disk(run_dir: Path) -> dict:
    from nemo_moe_metrics.report import render_report

    render_report(run_dir)
    pictures = {p.name: p.read_bytes() for p in run_dir.glob("*.png")}
    ballast = fi.fill_disk(run_dir.parent)
    try:
        proc = _cli("report", str(run_dir))
        after = {p.name: p.read_bytes() for p in run_dir.glob("*.png")}
        hidden = [p.name for p in run_dir.glob(".*.tmp*")]
    finally:
        ballast.unlink()
    return {"proc": proc, "before": pictures, "after": after, "hidden": hidden}


def test_a_second_run_resume_or_overwrite_of_a_live_run_is_refused_naming_it(chain):
    job = chain["sigint"]["job"]
    for proc in chain["sigint"]["extra"]:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        text = proc.stderr
        assert f"{fi.NAME} is in use by another run: nemo-moe-metrics run " in text, text
        assert f"(pid {job.proc.pid} on host " in text and " ago). Wait for it to end" in text
        assert "Traceback" not in text


def test_ctrl_c_stops_every_process_prints_one_line_and_exits_130(chain):
    seen = chain["sigint"]
    assert seen["status"] == 130
    assert not seen["left"], f"still running after Ctrl-C: {seen['left']}"
    lines = [x for x in seen["said"].splitlines() if x.strip()]
    assert "Traceback" not in seen["said"] and "KeyboardInterrupt" not in seen["said"]
    said = [x for x in lines if x.startswith("interrupted")]
    assert len(said) == 1 and lines[-1] == said[0]
    assert said[0].startswith("interrupted (SIGINT): stopped the training job (")
    assert "it keeps every step up to " in said[0] and said[0].endswith("--resume")


def test_kill_9_of_run_stops_torchrun_and_every_rank(chain):
    seen = chain["kill-run"]
    assert seen["status"] == -9
    assert len(seen["job"].seen) >= 4, "run, the launch process, torchrun and 2 ranks were seen"
    assert not seen["left"], f"still running 20 s after kill -9 of run: {seen['left']}"
    assert seen["gone_s"] < 15


def test_a_rank_killed_by_sigkill_is_named_not_the_rank_it_broke(chain):
    seen = chain["kill-rank"]
    assert seen["status"] == 1
    lines = seen["said"].splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("run failed (exit 1)"))
    assert lines[i + 1].startswith("rank 1 was killed by SIGKILL (signal 9) without a Python error")
    # The other rank's error comes after it, as its consequence, if it had time to raise one.
    assert all("rank 0 raised" not in x for x in lines), seen["said"]
    assert not seen["left"]


@pytest.mark.parametrize("fault", NAMED_FAULTS)
def test_each_fault_is_named_by_what_happened_and_leaves_no_process(chain, fault):
    seen = chain[fault]
    assert seen["extra"] == fault, "the fault came before the ranks started"
    assert fi.expectation(fault, seen["status"], seen["said"]), seen["said"][-3000:]
    assert not seen["left"]
    assert "out of memory?" not in seen["said"]


def test_a_full_disk_ends_the_run_with_one_message_naming_the_file(tmp_path):
    # What `run` prints when rank 0 stopped at a failed write (the whole job on a full disk:
    # benchmarks/fault_injection.py --faults disk-full --disk-full): rank 0's own words, kept
    # outside the full disk, then the disk's state; the rank log itself may be cut.
    from nemo_moe_metrics.launch import failure_report
    from nemo_moe_metrics.launch.failures import LAST_WORDS_ENV, record_failure
    from nemo_moe_metrics.sinks.base import SinkWriteError

    with fi.small_filesystem(1) as small:
        if small is None:
            pytest.skip(
                "mounting a small tmpfs needs root (e2e/test_hardening.py covers the write)"
            )
        run_dir = small / fi.NAME
        run_dir.mkdir()
        fi.fill_disk(small)
        words = tmp_path / "rank_errors.jsonl"
        os.environ[LAST_WORDS_ENV] = str(words)
        try:
            raise SinkWriteError(28, f"cannot write {run_dir}/metrics.jsonl: No space left ...")
        except SinkWriteError as err:
            record_failure(err, rank=0)
        finally:
            del os.environ[LAST_WORDS_ENV]
        text = failure_report(run_dir, 1, last_words=words)
    lines = text.splitlines()
    assert lines[0] == "run failed (exit 1)"
    assert lines[1] == (
        f"rank 0 raised SinkWriteError: cannot write {run_dir}/metrics.jsonl: No space left ..."
    )
    assert any(x.startswith("the run directory's file system is full (0 bytes free") for x in lines)


def test_every_step_is_once_in_metrics_jsonl_the_store_and_tensorboard(chain):
    final = chain["final"]
    assert final["max_steps"] >= 3 * STEP_BATCH  # three resumed runs logged steps
    for sink, steps in final["steps"].items():
        assert fi.lost_and_duplicated(steps, final["max_steps"]) == {
            "lost": [],
            "duplicated": [],
        }, sink


def test_a_resume_after_every_fault_trains_every_step_once_in_every_sink(chain):
    resumed = chain["resumed"]
    assert resumed["status"] == 0
    for sink, steps in resumed["steps"].items():
        got = fi.lost_and_duplicated(steps, max(resumed["steps"]["metrics.jsonl"]) + 1)
        assert got == {"lost": [], "duplicated": []}, sink
    assert max(resumed["steps"]["metrics.jsonl"]) + 1 == chain["final"]["max_steps"] + 2
    # --resume reaches the ranks as logger.resume=true (the recipe they ran is saved)
    assert "resume: true" in resumed["recipe"]


def test_report_on_a_full_disk_says_so_and_leaves_no_empty_picture(chain):
    seen = chain["report"]
    if seen is None:
        pytest.skip("mounting a small tmpfs needs root")
    proc = seen["proc"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: cannot write " in proc.stderr and "No space left on device" in proc.stderr
    assert "--out DIR" in proc.stderr
    assert seen["after"] == seen["before"] and all(len(b) > 1000 for b in seen["after"].values())
    assert seen["hidden"] == []


def test_a_full_small_filesystem_ends_logging_at_the_failed_write(tmp_path):
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.sinks import SinkWriteError, build_sinks
    from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

    with fi.small_filesystem(1) as small:
        if small is None:
            pytest.skip("mounting a small tmpfs needs root")
        cfg = LoggerConfig(wandb_enabled=False, tensorboard_enabled=False, table_every=1)
        sink = build_sinks(cfg, small, run_name="full")
        rng = np.random.default_rng(0)
        logged = []
        with pytest.raises(SinkWriteError) as err:
            for step in range(1000):  # 94 x 256 tables of random counts: about 60 KB each
                rows = [[la, e, int(c), 1.0] for la in range(94)
                        for e, c in enumerate(rng.integers(0, 2**31, 256))]  # fmt: skip
                sink.log({"moe/expert_loads": rows, "train_perf/tokens": 1.0}, step)
                logged.append(step)
        assert "No space left on device (ENOSPC)" in str(err.value)
        assert f"cannot write {small}/" in str(err.value)
        assert f"steps up to {logged[-1]} are saved" in str(err.value)
        # What was written stays readable: every step whose log returned, in both files.
        stored = [s for s, _, _ in read_expert_loads(store_path(small), skipped=[])]
        assert stored[: len(logged)] == logged
        assert fi.logged(small)[: len(logged)] == logged
        assert len(logged) >= 5


def test_resume_over_an_emptied_metrics_jsonl_is_refused_before_launching(tmp_path):
    # An empty metrics.jsonl beside TensorBoard's steps used to restart at step 0 over them.
    from nemo_moe_metrics.config import LoggerConfig
    from nemo_moe_metrics.sinks import build_sinks

    run_dir = tmp_path / fi.NAME
    sink = build_sinks(LoggerConfig(wandb_enabled=False), run_dir, run_name=fi.NAME)
    for step in range(3):
        sink.log({"train_perf/tokens": 1.0}, step)
    sink.close()
    (run_dir / "metrics.jsonl").write_text("")
    events = {p: p.read_bytes() for p in (run_dir / "tensorboard").iterdir()}
    proc = _cli("run", str(fi.RECIPE), *fi.OVERRIDES, "--output-dir", str(tmp_path), "--resume")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is empty, but logged steps remain in tensorboard/ (scalar events)" in proc.stderr
    assert "Restore metrics.jsonl (from a backup), or start afresh with --overwrite" in (
        proc.stderr
    )
    assert {p: p.read_bytes() for p in (run_dir / "tensorboard").iterdir()} == events
    assert "starting ranks" not in proc.stdout
