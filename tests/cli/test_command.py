"""The console script validates recipes and reports config errors without a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_moe_metrics.cli", *args], capture_output=True, text=True
    )


def test_check_prints_recipe_with_override():
    proc = _cli("check", str(RECIPE), "policy.megatron_cfg.moe_per_layer_logging=true")
    assert proc.returncode == 0, proc.stderr
    assert "moe_per_layer_logging: true" in proc.stdout


def test_check_reports_typo_with_exit_2():
    proc = _cli("check", str(RECIPE), "policy.megatron_cfg.track_moe_metric=true")
    assert proc.returncode == 2
    assert "did you mean 'track_moe_metrics'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_option_is_still_an_error():
    proc = _cli("check", str(RECIPE), "--no-such-option")
    assert proc.returncode == 2
    assert "unrecognized arguments: --no-such-option" in proc.stderr


def test_override_after_option_reaches_the_recipe(capsys):
    from nemo_moe_metrics.cli import main

    # `run` validates the recipe before launching anything: a typo after --nproc is reported.
    assert main(["run", str(RECIPE), "--nproc", "2", "policy.megatron_cfg.track_flop=true"]) == 2
    assert "did you mean 'track_flops'" in capsys.readouterr().err


def test_the_command_and_its_light_subcommands_start_without_torch():
    # check, report, placement, ingest and flops need no torch; importing it costs every
    # invocation about two seconds of CPU (a launch, a Slurm dry run, each CLI test).
    modules = [
        "nemo_moe_metrics.cli",
        "nemo_moe_metrics.report",
        "nemo_moe_metrics.config.preflight",
    ]
    modules += ["nemo_moe_metrics.cli.placement", "nemo_moe_metrics.run_dir.session"]
    heavy = ("torch", "megatron", "transformers", "ray", "nemo_run", "matplotlib")
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(h for h in {heavy!r} if h in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
