"""What the Slurm scripts share (launch/slurm_script.py): flags that do not go together, and every
refusal or failure as one line with its status, before or instead of anything submitted. The two
scripts through a real Slurm controller: test_slurm_job.py, test_ray_slurm.py."""

from __future__ import annotations

import argparse

import pytest

from nemo_moe_metrics.config import ConfigError
from nemo_moe_metrics.launch.slurm_script import (
    FAILED,
    USAGE,
    add_job_flags,
    check_job_flags,
    run_job_script,
)

pytestmark = pytest.mark.one_line  # no megatron-core in it


def _parse(*argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="script.py")
    add_job_flags(parser, job_dir_help="the job's files")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    for flag in ("--account", "--partition"):
        parser.add_argument(flag)
    for flag, default in (("--nodes", 1), ("--gpus-per-node", 8), ("--ranks-per-node", None)):
        parser.add_argument(flag, type=int, default=default)
    return parser, parser.parse_intermixed_args(argv)


def _run(args: argparse.Namespace, calls: list[str], **steps) -> int:
    def step(name):
        def call(*_):
            calls.append(name)
            if name in steps:
                raise steps[name]
            return "the dry run's text"

        return call

    return run_job_script(
        args, script="script.py", dry_run=step("dry_run"), submit=step("submit"),
        submitted=step("submitted"), files_are="the job's files",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["r.yaml", "--account", "a"], "a recipe, --account and --partition are required"),
        (["r.yaml", "--follow", "12"], "--follow JOB_ID takes no recipe"),
        (["r.yaml", "--account", "a", "--partition", "p", "--wait"], "go with --submit"),
        (["r.yaml", "--account", "a", "--partition", "p", "--resume"], "go with --submit"),
    ],
)
def test_flags_that_do_not_go_together_are_a_usage_error(argv, words, capsys):
    parser, args = _parse(*argv)
    with pytest.raises(SystemExit) as stopped:
        check_job_flags(parser, args)
    assert stopped.value.code == USAGE and words in capsys.readouterr().err


def test_the_dry_run_is_printed_and_nothing_else_is_called(capsys):
    _, args = _parse("r.yaml", "k=v", "--account", "a", "--partition", "p")
    calls: list[str] = []
    assert _run(args, calls) == 0
    assert calls == ["dry_run"] and capsys.readouterr().out == "the dry run's text\n"


def test_an_impossible_layout_is_refused_before_the_dry_run(capsys):
    _, args = _parse("r.yaml", "--account", "a", "--partition", "p", "--nodes", "0")
    calls: list[str] = []
    assert _run(args, calls) == USAGE and calls == []
    assert capsys.readouterr().err.startswith("error: --nodes 0 --gpus-per-node 8: nodes must")


def test_submit_without_sbatch_is_refused_naming_the_login_node(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without sbatch
    _, args = _parse("r.yaml", "--account", "a", "--partition", "p", "--submit")
    calls: list[str] = []
    assert _run(args, calls) == USAGE and calls == []
    err = capsys.readouterr().err
    assert "--submit needs Slurm (sbatch is not on PATH): run it on a Slurm login node" in err


@pytest.mark.parametrize(
    ("raised", "status", "line"),
    [
        (ConfigError("recipe 'r' cannot run: x"), USAGE, "error: recipe 'r' cannot run: x\n"),
        (
            OSError("no route to host"),
            FAILED,
            "error: the dry run failed (OSError: no route to host); the job's files are in "
            "slurm_jobs/\n",
        ),
    ],
)
def test_a_failure_in_the_scripts_own_step_is_one_line_with_its_status(
    raised, status, line, capsys
):
    _, args = _parse("r.yaml", "--account", "a", "--partition", "p")
    assert _run(args, [], dry_run=raised) == status
    assert capsys.readouterr().err == line  # one line, no traceback


def test_following_an_unknown_job_names_the_job_directory(tmp_path, capsys):
    _, args = _parse("--follow", "12", "--job-dir", str(tmp_path))
    calls: list[str] = []
    assert _run(args, calls) == FAILED and calls == []
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"the job's files are in {tmp_path}/" in err
    assert len(err.splitlines()) == 1
