"""One run per directory, and nothing else is deleted: the rules of run_dir/record.py.

Through the real CLI where a refusal is what is tested (it comes before any process starts);
through the API for what a launcher does holding the lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.run_dir import RunDirLock
from nemo_moe_metrics.run_dir.names import LOCK_FILE
from nemo_moe_metrics.run_dir.record import prepare_run_dir

pytestmark = pytest.mark.one_line  # CLI behaviour: the same on both megatron-core lines

REPO = Path(__file__).resolve().parents[2]

GRPO = REPO / "examples" / "configs" / "grpo_moe_tiny.yaml"


def record_cli(*args: object, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *map(str, args)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )  # fmt: skip


def file_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_users_directory_survives_run_and_is_refused_naming_its_files(tmp_path, flags):
    run_dir = tmp_path / "out" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("keep\n")
    (run_dir / "launch.log").write_text("looks like a run's file, but the notes make it mine\n")
    before = file_tree(tmp_path)
    proc = record_cli("run", GRPO, "--output-dir", tmp_path / "out", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"holds files that no run wrote ({run_dir / 'notes.txt'})" in proc.stderr
    assert "--output-dir DIR, or the override name=NEW_NAME" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing deleted, nothing written (not even the lock file).
    assert file_tree(tmp_path) == before
    assert not (run_dir / LOCK_FILE).exists()


def test_a_run_that_failed_early_is_known_by_the_lock_it_left_and_cleared(tmp_path):
    run_dir = tmp_path / "grpo_moe_tiny"
    lock = RunDirLock(run_dir, command="nemo-moe-metrics run x.yaml").acquire()
    lock.mark_run()  # what `run` does once the directory is fit, before the job starts
    lock.release()
    (run_dir / "nemo_run" / "experiments").mkdir(parents=True)
    (run_dir / "launch.log").write_text("Traceback ...\n")
    (run_dir / "metrics.jsonl").write_text("")
    with RunDirLock(run_dir) as lock:
        assert lock.previous is not None and lock.previous.command == "nemo-moe-metrics run x.yaml"
        note = prepare_run_dir(run_dir, earlier_lock=lock.previous)
    assert (
        note
        == f"{run_dir}: the earlier run there logged no step (it failed early); starting afresh"
    )
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE]


def test_run_files_without_a_mark_of_a_run_are_refused_not_deleted(tmp_path):
    run_dir = tmp_path / "grpo_moe_tiny"
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "tensorboard" / "my_other_tool.txt").write_text("mine\n")
    (run_dir / "launch.log").write_text("mine too\n")
    before = file_tree(run_dir)
    for overwrite in (False, True):
        with RunDirLock(run_dir) as lock, pytest.raises(ConfigError) as err:
            prepare_run_dir(run_dir, overwrite=overwrite, earlier_lock=lock.previous)
        assert "no mark of a run" in str(err.value) and "not deleted" in str(err.value)
        assert {k: v for k, v in file_tree(run_dir).items() if k != LOCK_FILE} == before


def test_overwrite_deletes_a_logged_runs_files_and_nothing_through_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep\n")
    run_dir = tmp_path / "run"
    RunDirLock(run_dir).acquire().release()  # a lock that marks no run: the records prove it
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    (run_dir / "router_health.png").write_bytes(b"png")
    with RunDirLock(run_dir) as lock:
        with pytest.raises(ConfigError, match="already holds a run"):
            prepare_run_dir(run_dir, earlier_lock=lock.previous)
        assert prepare_run_dir(run_dir, overwrite=True, earlier_lock=lock.previous) is None
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE]
    # A run's file that is a link is refused (never followed, never deleted through).
    (run_dir / "wandb").symlink_to(outside)
    with pytest.raises(ConfigError, match="must not be symbolic links"):
        prepare_run_dir(run_dir, overwrite=True)
    assert (outside / "precious.txt").read_text() == "keep\n"


def test_a_file_where_the_run_directory_should_be_is_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "grpo_moe_tiny").write_text("a file\n")
    proc = record_cli("run", GRPO, "--output-dir", tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "out" / "grpo_moe_tiny").read_text() == "a file\n"


def _outside(tmp_path: Path, text: str) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_text(text)
    return target


def test_a_symlinked_lock_leaves_its_target_unchanged(tmp_path):
    from nemo_moe_metrics.run_dir import RunDirError

    target = _outside(tmp_path, "not a lock\n")
    run_dir = tmp_path / "out" / "grpo_moe_tiny"
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_FILE).symlink_to(target)
    proc = record_cli("run", GRPO, "--output-dir", tmp_path / "out")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run_dir / LOCK_FILE} -> {target}: a run's own files must not be" in proc.stderr
    with pytest.raises(RunDirError, match="is a symbolic link"):  # the lock alone refuses it too
        RunDirLock(run_dir).acquire()
    assert target.read_text() == "not a lock\n"
    hard = run_dir / "hard"
    os.link(target, hard)
    (run_dir / LOCK_FILE).unlink()
    os.rename(hard, run_dir / LOCK_FILE)  # a hard link: rewriting it would rewrite the target
    with pytest.raises(RunDirError, match="hard links"):
        RunDirLock(run_dir).acquire()
    assert target.read_text() == "not a lock\n"


def test_a_symlinked_metrics_jsonl_is_not_resumed_through(tmp_path):
    from nemo_moe_metrics import LoggerConfig, build_sinks
    from nemo_moe_metrics.sinks.jsonl import JsonlSink, cut_after

    records = '{"step": 0}\n{"step": 1}\n{"step": 2, "torn'
    target = _outside(tmp_path, records)
    run_dir = tmp_path / "out" / "grpo_moe_tiny"
    lock = RunDirLock(run_dir).acquire()
    lock.mark_run()
    lock.release()
    (run_dir / "metrics.jsonl").symlink_to(target)
    proc = record_cli("run", GRPO, "--output-dir", tmp_path / "out", "--resume")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{run_dir / 'metrics.jsonl'} -> {target}: a run's own files" in proc.stderr
    with pytest.raises(Exception, match="must not be symbolic links"):
        build_sinks(LoggerConfig(resume=True, wandb_enabled=False), run_dir, run_name="x")
    with pytest.raises(OSError):
        JsonlSink(run_dir / "metrics.jsonl")
    with pytest.raises(OSError):
        cut_after(run_dir / "metrics.jsonl", 3)
    assert target.read_text() == records


def test_an_unusable_output_dir_is_one_line_naming_the_path_and_the_error(tmp_path):
    (tmp_path / "a_file").write_text("x\n")
    cases = {
        tmp_path / "a_file" / "out": "Not a directory (ENOTDIR)",
        tmp_path / ("d" * 300): "File name too long (ENAMETOOLONG)",
    }
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = (
        os.geteuid() == 0
        and (
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)])
        ).returncode
        == 0
    )
    if mounted:
        cases[read_only / "out"] = "Read-only file system (EROFS)"
    try:
        for out, said in cases.items():
            proc = record_cli("run", GRPO, "--output-dir", out)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert proc.stderr.startswith(
                f"error: cannot use the run directory {out / 'grpo_moe_tiny'}: "
            ), proc.stderr
            assert said in proc.stderr and "Traceback" not in proc.stderr
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)])
    assert mounted or os.geteuid() != 0, "root could not mount a read-only tmpfs"
