"""Faults named by what happened, through the real CLI and real torchrun ranks.

One chain of ``nemo-moe-metrics run`` jobs (the tiny SFT recipe, 2 ranks) with the faults of
``benchmarks/fault_injection.py`` that make no Python error: a stopped rank (named while the
others wait for it), torchrun killed (its ranks' last words from torchelastic's log), a
stopped torchrun (a timeout, then the job is stopped). Then every step is in metrics.jsonl,
the store and TensorBoard exactly once.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import fault_injection as fi  # noqa: E402

pytestmark = [pytest.mark.one_line, pytest.mark.slow]
MAX_STEPS = 200


def _round(out: Path, fault: str) -> dict:
    run_dir = out / fi.NAME
    before = len(fi.logged(run_dir))
    job = fi.Job(out, MAX_STEPS, resume=before > 0)
    assert fi.wait_for_steps(job, run_dir, before + 1) >= before + 1, job.output(timeout=60)[1]
    done = fi.inject(job, fault, random.Random(0))
    status, said = job.output(timeout=240)
    _, left = job.wait_gone(timeout=20)
    return {"fault": done, "status": status, "said": said, "left": left}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    rounds = {f: _round(out, f) for f in ("stop-rank", "kill-torchrun", "stop-launcher")}
    final = fi.Job(out, max(fi.logged(out / fi.NAME)) + 2, resume=True)
    rounds["final"] = {"status": final.output(timeout=240)[0]}
    rounds["steps"] = fi.sink_steps(out / fi.NAME)
    return rounds


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["stop-rank", "kill-torchrun", "stop-launcher"])
def test_each_fault_is_named_by_what_happened_and_leaves_no_process(chain, fault):
    seen = chain[fault]
    assert seen["fault"] == fault, "the fault came before the ranks started"
    assert fi.expectation(fault, seen["status"], seen["said"]), seen["said"][-3000:]
    assert not seen["left"]
    assert "out of memory?" not in seen["said"]


@pytest.mark.timeout(900)
def test_every_step_is_once_in_every_sink_after_the_faults(chain):
    assert chain["final"]["status"] == 0
    for sink, steps in chain["steps"].items():
        got = fi.lost_and_duplicated(steps, max(chain["steps"]["metrics.jsonl"]) + 1)
        assert got == {"lost": [], "duplicated": []}, sink
