"""Arguments reach the ranks byte for byte: no quoting layer where no shell reads them.

nemo-run's torchrun component shell-quotes every argument and the local executor starts
torchrun without a shell; a local launch passes the ranks' arguments in the environment
(``train_args.py``). Through the real CLI and real torchrun ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_moe_metrics.launch.failures import LAST_WORDS_ENV, rank_failure_lines, read_failures
from nemo_moe_metrics.launch.train_args import ARGV_ENV, ARGV_FROM_ENV, rank_argv
from tests.conftest import SFT_TORCHRUN_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "examples" / "configs" / "sft_moe_tiny.yaml"
ODD = 'naïve 名前 "quoted" it\'s $HOME `x` \\back'

pytestmark = pytest.mark.one_line  # CLI behaviour: the same on both megatron-core lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_list_override_odd_values_and_an_output_dir_with_a_space_run_to_the_end(
    sft_torchrun_run,
):
    proc, run_dir, cwd = sft_torchrun_run  # conftest.py: the run, started from an empty cwd
    assert SFT_TORCHRUN_OVERRIDES[1] == f"logger.wandb_project={ODD}"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())  # what rank 0 parsed
    assert recipe["policy"]["model"]["moe_layer_freq"] == [0, 1, 1, 1]
    assert recipe["logger"]["wandb_project"] == ODD
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().split()]
    assert steps == [0, 1]
    # Nothing was written where a quoted path would have pointed (the caller's cwd).
    assert sorted(p.name for p in cwd.iterdir()) == [run_dir.parent.name]


def test_rank_argv_returns_the_environment_list_unchanged():
    argv = ["--recipe", "r.yaml", "--output-dir", "/a b/c", "k=[0,1]", ODD]
    assert rank_argv([ARGV_FROM_ENV], {ARGV_ENV: json.dumps(argv)}) == argv
    assert rank_argv(argv, {}) == argv  # a command line of its own (Slurm, by hand) as given
    with pytest.raises(ValueError, match=ARGV_ENV):
        rank_argv([ARGV_FROM_ENV], {ARGV_ENV: '{"not": "a list"}'})


def test_a_rank_that_refuses_its_arguments_is_reported_as_that(tmp_path):
    words = tmp_path / "rank_errors.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), LAST_WORDS_ENV: str(words), "RANK": "1"}
    argv = ["--recipe", str(SFT), "--output-dir", str(tmp_path), "'training.max_steps=2'"]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.train", *argv],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = rank_failure_lines(None, read_failures(words))
    assert lines[0].startswith("rank 1 refused its arguments: invalid recipe ")
    assert "'training" in lines[0]  # the key with the quote it got, named
    assert f"the rank's arguments, as it got them: {argv!r}" in lines[0]
    assert "no Python exception" not in "\n".join(lines)
