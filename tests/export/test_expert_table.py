"""The expert-load table as one array value: checked once, rows only on demand, arrays end to
end."""

import pickle

import numpy as np
import pytest

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.expert_table import ExpertTable
from nemo_moe_metrics.moe.balance import ExpertLoads, expert_load_metrics
from nemo_moe_metrics.sinks.base import MultiSink, validate_metrics
from nemo_moe_metrics.sinks.store import ExpertLoadSink, read_expert_loads


def _rows_by_hand(layer_ids, counts, widths):
    """The documented rows, one cell at a time: [layer, expert, tokens, 100 * tokens / total]."""
    rows = []
    for layer, c, w in zip(layer_ids, counts, widths, strict=True):
        total = sum(int(x) for x in c[:w])
        for e in range(w):
            rows.append([int(layer), e, int(c[e]), 100.0 * int(c[e]) / total if total else 0.0])
    return rows


def _loads():
    counts = np.array([[5, 0, 3, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=np.int64)
    return ExpertLoads(
        layer_ids=[1, 4, 7],
        counts=counts,
        routed_tokens=np.array([4, 1, 0]),
        topk=2,
        num_experts=[4, 2, 3],
    )


def test_the_metrics_table_is_one_array_value_whose_rows_are_the_documented_ones():
    loads = _loads()
    table = expert_load_metrics(loads, per_layer=False, table=True)[mn.EXPERT_LOADS]
    assert isinstance(table, ExpertTable)
    np.testing.assert_array_equal(table.counts, loads.counts)
    assert table.layer_ids.tolist() == [1, 4, 7] and table.widths.tolist() == [4, 2, 3]
    expected = _rows_by_hand([1, 4, 7], loads.counts, [4, 2, 3])
    assert len(table) == len(expected) == 9
    for got, want in zip(table, expected, strict=True):
        assert got[:3] == want[:3] and type(got[2]) is int
        assert got[3] == pytest.approx(want[3], rel=1e-15)
    assert table == expected and table[3] == expected[3]  # compares like the list it replaces
    assert np.array(table, dtype=np.int64)[:, 2].tolist() == [r[2] for r in expected]


def test_len_and_the_arrays_need_no_rows():
    table = ExpertTable([0, 1], np.ones((2, 256), dtype=np.int64))
    assert len(table) == 512
    assert table._rows is None  # nothing asked for rows: none built
    assert table.rows is table.rows  # built once, then kept


def test_bad_arrays_are_refused_once_naming_the_problem():
    with pytest.raises(ValueError, match="one layer id per row"):
        ExpertTable([0, 1, 2], np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match=">= 0"):
        ExpertTable([0], np.array([[1, -1]]))
    with pytest.raises(TypeError, match="integers"):
        ExpertTable([0], np.array([[1.5, 2.0]]))
    with pytest.raises(ValueError, match="between 1 and 4"):
        ExpertTable([0], np.zeros((1, 4), dtype=np.int64), widths=[5])


def test_validation_passes_the_value_through_and_still_checks_hand_made_rows():
    table = ExpertTable([3], np.array([[2, 2]]))
    assert validate_metrics({mn.EXPERT_LOADS: table}, 0)[mn.EXPERT_LOADS] is table
    with pytest.raises(ValueError, match="row 0"):
        validate_metrics({mn.EXPERT_LOADS: [[3, 0, 2]]}, 0)


class _Recorder:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append(metrics)

    def close(self):
        pass


def test_the_store_keeps_the_arrays_and_hand_made_rows_alike(tmp_path):
    loads = _loads()
    metrics = expert_load_metrics(loads, per_layer=False, table=True)
    table = metrics[mn.EXPERT_LOADS]
    sink = ExpertLoadSink(tmp_path / "a.bin", fsync=False)
    rows_sink = ExpertLoadSink(tmp_path / "b.bin", fsync=False)
    recorder = _Recorder()
    MultiSink([sink, recorder]).log(metrics, 0)
    rows_sink.log({mn.EXPERT_LOADS: _rows_by_hand([1, 4, 7], loads.counts, [4, 2, 3])}, 0)
    sink.close()
    rows_sink.close()
    assert recorder.logged[0][mn.EXPERT_LOADS] is table  # the one value, no copy into rows
    assert table._rows is None  # the store read arrays: no row was made on the way
    (a,) = read_expert_loads(tmp_path / "a.bin")
    (b,) = read_expert_loads(tmp_path / "b.bin")
    for got in (a, b):
        assert got.step == 0 and got.layer_ids.tolist() == [1, 4, 7]
        assert got.widths.tolist() == [4, 2, 3]
        np.testing.assert_array_equal(got.counts[:, :4], loads.counts)


def test_the_value_survives_pickling_between_processes():
    table = ExpertTable([2, 5], np.arange(8).reshape(2, 4), widths=[4, 3])
    back = pickle.loads(pickle.dumps(table))
    assert back == table and back.rows == table.rows
