"""benchmarks/: the host-read counter counts what it claims, and ``run.py --smoke`` reports every
key.

The benchmark's numbers are not asserted (they depend on the machine); the instrument that counts
host reads is, with expected counts written out by hand, and the smoke run must pass its own
correctness checks of the measured path.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from browser import REQUIRE as REQUIRE_BROWSER  # noqa: E402

from benchmarks.host_reads import HostReadCounter  # noqa: E402
from benchmarks.run import BROWSER_KEYS, NOT_IN_SMOKE, RESULT_KEYS, median_ci95  # noqa: E402


def _count(fn) -> int:
    with HostReadCounter() as counter:
        fn()
    return counter.total


# ------------------------------------------------------------------------------- the counter
@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: x.numpy(),
        lambda x: bool(x.sum() > 0),
        lambda x: int(x[0]),
        lambda x: float(x[0]),
        lambda x: np.asarray(x),
        lambda x: x.cpu(),
        lambda x: x.nonzero(),
        lambda x: x[x > 2],
    ],
    ids=["item", "tolist", "numpy", "bool", "int", "float", "asarray", "cpu", "nonzero", "mask"],
)
def test_counter_counts_each_kind_of_host_read_once(read):
    assert _count(lambda: read(torch.arange(5.0))) == 1


def test_counter_counts_a_copy_and_its_read_as_one():
    x = torch.arange(5.0)
    assert _count(lambda: x.cpu().numpy()) == 1
    assert _count(lambda: (x.cpu().numpy(), x.cpu().tolist())) == 2


def test_counter_ignores_device_work_and_moves_that_stay_on_the_device():
    x = torch.arange(5.0)

    def device_only():
        y = (x * 2).sum(0)
        x.to(torch.int64)  # a dtype change, no device
        x.to("cpu")  # the collective device under gloo; under NCCL .to(cuda), not a read
        x.to("cpu", non_blocking=True)  # the read, if any, comes later
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 2]), torch.ones(2))
        return y

    assert _count(device_only) == 0


def test_counter_segments_split_at_marks():
    x = torch.arange(3.0)
    with HostReadCounter() as counter:
        x.tolist()
        counter.mark()
        counter.mark()
        x.tolist()
        x.sum().item()
    assert counter.segments == [1, 0, 2]
    assert counter.total == 3


def test_counter_names_the_call_site():
    with HostReadCounter() as counter:
        torch.ones(2).tolist()
    (site,) = counter.by_site
    assert site.startswith("Tensor.tolist @ test_benchmarks.py:")


# ------------------------------------------------------------------------------- statistics
def _binomial_coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n-k+1)) for n samples, k 1-based."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize("n", [6, 9, 16, 20, 40])
def test_median_ci95_is_the_narrowest_order_statistic_interval_covering_95_percent(n):
    values = [float(v) for v in range(1, n + 1)]  # x_(i) = i
    low, high = median_ci95(values)
    k = int(low)
    assert high == n - k + 1
    assert _binomial_coverage(n, k) >= 0.95
    assert _binomial_coverage(n, k + 1) < 0.95


# ------------------------------------------------------------------------------- the harness
@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=480,  # tiny sizes, but several spawned step models; slow on a loaded machine
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_smoke_run_reports_every_result_key_with_its_target(smoke):
    _, result = smoke
    # The page's first chart needs Chromium: absent (and said so) only where none runs.
    no_browser = "not measured" in str((result["details"].get("html") or {}).get("browser"))
    if os.environ.get(REQUIRE_BROWSER) == "1":
        assert not no_browser, result["details"]["html"]
    assert "not measured in --smoke" in result["details"]["ray"]
    for key in RESULT_KEYS:
        if (no_browser and key in BROWSER_KEYS) or key in NOT_IN_SMOKE:
            continue
        assert key in result, key
        assert key in result["met"] and key in result["targets"]
    assert all(
        math.isfinite(result[k]) and result[k] > 0
        for k in ("step_overhead_ratio", "export_ms_40x256", "flops_estimate_ms_4096")
    )


def test_smoke_run_gives_each_metric_familys_own_cpu_time(smoke):
    _, result = smoke
    families = result["details"]["step"]["family_cpu_ms_per_step"]
    expected = {
        *("ExpertLoads", "MegatronAuxLoss", "ExpertBias", "RouterHealth"),
        *("RoutingConsistency", "Throughput"),
    }
    assert expected <= set(families)
    # Finite CPU times whose total is some work. Not each family > 0: a smoke step is a few
    # milliseconds of CPU, and the expert loads' share is a difference of two clocks (the
    # collector's hooks minus the health and routing work timed inside them), which one fresh
    # CI run saw fail.
    assert all(math.isfinite(v) for v in families.values())
    assert sum(families.values()) > 0
    assert result["table_step_host_ms_94x256"] > 0
    assert result["checks"]["table_step_rows_94x256"]
    trl = result["details"]["trl"]
    if isinstance(trl, dict):  # TRL installed (always on CI): the callback's own time, timed
        assert trl["callback_cpu_ms_per_step"] > 0 and trl["callback_cpu_ratio"] > 1


def test_smoke_run_counts_host_reads_as_integers(smoke):
    _, result = smoke
    for key in ("syncs_per_microbatch", "syncs_per_export"):
        assert isinstance(result[key], int) and not isinstance(result[key], bool), key
    # One read for every family together (aux losses, expert loads, throughput); zero would
    # mean a blind counter.
    assert result["syncs_per_export"] == 1
    assert result["details"]["export"]["host_reads_per_export"] >= 1


def test_smoke_run_passes_its_checks_of_the_measured_path(smoke):
    _, result = smoke
    assert result["checks"], "no checks were made"
    assert all(result["checks"].values()), result["checks"]


def test_smoke_run_records_the_machine(smoke):
    proc, result = smoke
    machine = result["machine"]
    assert machine["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert machine["logical_cpus"] >= 1 and machine["cpu_model"]
    assert "step_overhead_ratio" in proc.stdout


def test_smoke_run_measures_the_store_and_wandb_tables_at_94x256(smoke):
    _, result = smoke
    store = result["details"]["store"]
    # 94 x 256 counts: compressed below raw 32-bit integers, and amortised over the cadence.
    assert 0 < store["store_bytes_per_table_step"] < 94 * 256 * 4
    assert result["store_bytes_per_step_94x256"] == pytest.approx(
        store["store_bytes_per_table_step"] / store["table_every"]
    )
    assert store["wandb"]["table_step_ms"] > store["wandb"]["scalar_step_ms"] > 0
    assert result["checks"]["store_round_trip_exact"] is True


def test_smoke_run_reports_on_a_table_every_step_and_times_wandb_loaded(smoke):
    proc, result = smoke
    report = result["details"]["report"]
    # The every-step run: one table per step, read whole, its planted streak found.
    assert report["every_step"]["tables_in_store"] == report["steps"]
    assert result["checks"]["report_every_step_reads_every_logged_step"] is True
    assert result["checks"]["report_every_step_finds_the_dead_streak"] is True
    assert result["report_seconds_10k_94x256_every_step"] > 0
    assert result["report_peak_rss_mb_10k_94x256_every_step"] > 0
    loaded = result["details"]["store"]["wandb_loaded"]
    assert loaded["busy_loop_processes"] == (os.cpu_count() or 1)
    assert loaded["table_step_ms"] > 0
    assert "report_seconds_10k_94x256_every_step" in proc.stdout
    assert "wandb_table_ms_94x256_loaded" in proc.stdout
