"""`.ci/run` exits with its tests' verdict: its clean-up on exit must not turn green into red."""

import re
import subprocess
from pathlib import Path

import pytest

CI_SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "run"


def _exit_trap() -> str:
    found = re.search(r"^trap '(.*)' EXIT$", CI_SCRIPT.read_text(), re.MULTILINE)
    assert found, ".ci/run no longer sets its EXIT trap on one line; update this test"
    return found[1]


@pytest.mark.parametrize("verdict, expected", [("true", 0), ("false", 1)])
def test_exit_trap_keeps_the_verdict(tmp_path, verdict, expected):
    # As at the end of .ci/run: errexit on, the 3.12 line already waited for (no children left),
    # and the last command is the verdict. A failing pkill in the trap used to make CI exit 1.
    script = (
        "set -euo pipefail\n"
        "sleep 0 & line312=$!\n"
        'wait "$line312"\n'
        f"trap '{_exit_trap()}' EXIT\n"
        f"{verdict}\n"
    )
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == expected, proc.stderr


def test_ci_installs_the_slurm_packages_the_test_cluster_needs_and_requires_it():
    # tests/launch/test_slurm_job.py skips without Slurm; in CI it must run, on the packages that
    # tests/support/slurm_cluster.py would install itself.
    from slurm_cluster import PACKAGES

    text = CI_SCRIPT.read_text()
    packages = re.search(r'^  packages="([^"$]+)"$', text, re.M)
    assert packages, ".ci/run no longer lists the Slurm packages it installs; update this test"
    assert packages[1].split() == list(PACKAGES)
    assert re.search(r"apt-get install -y -q \\\n\s+--no-install-recommends \$packages\n", text)
    assert re.search(r"^NEMO_MOE_METRICS_REQUIRE_SLURM=1 .*run_pytest pytest -q ", text, re.M)


def test_ci_installs_chromium_and_requires_the_browser_tests_to_run():
    # tests/support/browser.py skips without Chromium; in CI the page's browser tests must run.
    from browser import CHROMIUM, REQUIRE

    text = CI_SCRIPT.read_text()
    assert CHROMIUM == "/usr/bin/chromium"  # where Debian's package puts it
    assert re.search(r'^if ! command -v chromium .*packages="\$packages chromium"; fi$', text, re.M)
    assert re.search(
        rf"^NEMO_MOE_METRICS_REQUIRE_SLURM=1 {REQUIRE}=1 run_pytest pytest -q", text, re.M
    )
