"""Writing the expert-load store (sinks/store_writer.py): bad counts refused with the problem
named, no append after close, tables become counts in layer order, the sink stores only the
table cadence's steps."""

import numpy as np
import pytest

from nemo_moe_metrics.sinks.store import (
    ExpertLoadSink,
    ExpertLoadStore,
    StoreError,
    read_expert_loads,
    store_path,
    table_to_counts,
)


@pytest.mark.parametrize(
    ("ids", "counts", "match"),
    [
        ([0, 1], np.ones((3, 4), dtype=np.int64), "shape"),
        ([0], np.ones((1, 4)) * 0.5, "integers"),
        ([0], -np.ones((1, 4), dtype=np.int64), ">= 0"),
        ([0], np.ones(4, dtype=np.int64), "shape"),
        ([-1], np.ones((1, 4), dtype=np.int64), "layer ids"),
    ],
)
def test_bad_counts_are_refused_with_the_problem_named(tmp_path, ids, counts, match):
    with ExpertLoadStore(store_path(tmp_path)) as store, pytest.raises(StoreError, match=match):
        store.append(0, ids, counts)


def test_append_after_close_is_an_error(tmp_path):
    store = ExpertLoadStore(store_path(tmp_path))
    store.close()
    with pytest.raises(RuntimeError, match="after close"):
        store.append(0, [0], np.ones((1, 2), dtype=np.int64))


def test_table_rows_become_counts_in_layer_order_of_appearance():
    rows = [[5, 1, 7, 70.0], [5, 0, 3, 30.0], [2, 2, 9, 100.0]]
    ids, counts = table_to_counts(rows)
    assert ids.tolist() == [5, 2]
    assert counts.tolist() == [[3, 7, 0], [0, 0, 9]]


def test_worker_layout_table_becomes_the_same_counts():
    rng = np.random.default_rng(3)
    expected = rng.integers(0, 1000, size=(4, 6))
    rows = [[10 + la, e, int(expected[la, e]), 0.0] for la in range(4) for e in range(6)]
    ids, counts = table_to_counts(rows)
    assert ids.tolist() == [10, 11, 12, 13]
    np.testing.assert_array_equal(counts, expected)


def test_sink_stores_only_steps_on_the_table_cadence(tmp_path):
    sink = ExpertLoadSink(store_path(tmp_path), table_every=3)
    for step in range(1, 8):
        sink.log({"moe/expert_loads": [[0, 0, step, 100.0]], "moe/max_over_ideal": 1.0}, step)
    sink.log({"moe/max_over_ideal": 1.0}, 9)  # no table that step: nothing stored
    sink.close()
    got = list(read_expert_loads(store_path(tmp_path)))
    assert [(s, c.tolist()) for s, _, c in got] == [(3, [[3]]), (6, [[6]])]
