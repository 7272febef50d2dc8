"""The Ray worker group (launch/ray_group.py): a dead actor reported as its rank and node, with
how it died."""

from __future__ import annotations

import pytest

# The CLI, Ray and the driver's merge: what they check does not depend on the megatron-core
# line (the actors run the same worker the torchrun tests run on both lines).
pytestmark = pytest.mark.one_line


def test_a_dead_actor_is_reported_as_its_rank_and_node_with_how_it_died(tmp_path, monkeypatch):
    from nemo_moe_metrics.launch.failures import LAST_WORDS_ENV, read_failures, record_rank_failure
    from nemo_moe_metrics.launch.ray_group import WorkerGroupError

    where = {"pid": 321, "host": "gpu7", "node_ip": "10.0.0.7", "node_id": "abcdef0123456789"}
    err = WorkerGroupError(1, where, "died", "its process ended without a Python error (in train)")
    assert str(err) == (
        "rank 1 (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345) died: its process "
        "ended without a Python error (in train)"
    )
    monkeypatch.setenv(LAST_WORDS_ENV, str(tmp_path / "words.jsonl"))
    record_rank_failure(err.recorded())
    raised = WorkerGroupError(0, where, "raised", "ValueError: bad", frame="x.py:3 in f")
    record_rank_failure(raised.recorded())
    first, second = read_failures(tmp_path / "words.jsonl")
    assert first.describe() == (
        "rank 1 died (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345): its process "
        "ended without a Python error (in train)"
    )
    assert second.describe().splitlines() == [
        "rank 0 raised ValueError: bad (actor pid 321 on node gpu7 10.0.0.7, node id abcdef012345)",
        "  at x.py:3 in f",
    ]
