"""What a worker returns for a step and the driver's merge (worker/results.py): the group's dict
taken once, mixed results refused, the expert table pickled as its arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

# The CLI, Ray and the driver's merge: what they check does not depend on the megatron-core
# line (the actors run the same worker the torchrun tests run on both lines).
pytestmark = pytest.mark.one_line


def test_the_merge_takes_the_groups_dict_once_and_refuses_mixed_results():
    from nemo_moe_metrics.worker.results import (
        WorkerResult,
        log_worker_results,
        merge_worker_results,
        worker_result,
    )

    step = {"moe/max_over_ideal": 1.5, "train_perf/tokens": 96}
    # Rank 0 sends the dict, the others its keys' digest (one copy crosses to the driver).
    results = [worker_result(step, step=4, rank=r, node="n") for r in (1, 0)]
    assert [bool(r.metrics) for r in results] == [False, True]
    assert merge_worker_results(results, {"train/reward": 0.5}) == {**step, "train/reward": 0.5}
    logged = []

    class Sink:
        def log(self, metrics, at):
            logged.append((at, metrics))

    log_worker_results(results, Sink())
    assert logged == [(4, step)]
    with pytest.raises(ValueError, match="different steps"):
        merge_worker_results([WorkerResult(0, 4, step), WorkerResult(1, 5, step)])
    with pytest.raises(ValueError, match="rank 1 returned other keys than rank 0"):
        merge_worker_results([WorkerResult(0, 4, step), WorkerResult(1, 4, {"moe/x": 1})])
    other = worker_result({"moe/x": 1}, step=4, rank=1)  # a digest of other keys
    with pytest.raises(ValueError, match="rank 1 returned other keys than rank 0"):
        merge_worker_results([results[1], other])
    with pytest.raises(ValueError, match="none of ranks \\[1\\] sent its step dict"):
        merge_worker_results([results[0]])
    with pytest.raises(ValueError, match=r"both produced \['moe/max_over_ideal'\]"):
        merge_worker_results(results, {"moe/max_over_ideal": 2.0})
    with pytest.raises(ValueError, match="no worker results"):
        merge_worker_results([])


def test_the_expert_table_crosses_a_pickle_as_its_arrays_never_its_rows():
    from nemo_moe_metrics.export.expert_table import ExpertTable

    table = ExpertTable(np.arange(94), np.random.default_rng(0).integers(0, 999, (94, 256)))
    arrays = len(pickle.dumps(table))
    assert len(table.rows) == 94 * 256  # the rows view, built once the sinks ask for it
    assert len(pickle.dumps(table)) == arrays < 94 * 256 * 8 + 4096
    back = pickle.loads(pickle.dumps(table))
    assert back == table and back.rows == table.rows
