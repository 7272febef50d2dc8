"""What every sink shares (sinks/base.py): metrics checked before any sink writes (tensors, lists,
table widths, NaN cells, negative steps), tables split from scalars, and the fan-out that keeps
the other sinks going when one fails and asks for tables only on their cadence."""

import math
import warnings

import pytest

from nemo_moe_metrics.config import LoggerConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks import METRICS_FILE, MultiSink, build_sinks
from nemo_moe_metrics.sinks.jsonl import JsonlSink
from nemo_moe_metrics.sinks.store import ExpertLoadSink, store_path
from tests.sinks.test_jsonl import jsonl_lines

JSONL_ONLY = LoggerConfig(tensorboard_enabled=False, wandb_enabled=False)


def test_tensor_value_is_refused_with_the_fix_in_the_message(tmp_path):
    import torch

    sink = MultiSink([JsonlSink(tmp_path / METRICS_FILE)])
    with pytest.raises(TypeError, match=r"moe/max_over_ideal.*torch.Tensor.*synchronisation"):
        sink.log({mn.MAX_OVER_IDEAL: torch.tensor(1.0)}, step=0)


def test_list_under_a_non_table_key_is_refused(tmp_path):
    sink = MultiSink([JsonlSink(tmp_path / METRICS_FILE)])
    with pytest.raises(TypeError, match=r"'moe/max_over_ideal' is a list.*TABLE_COLUMNS"):
        sink.log({mn.MAX_OVER_IDEAL: [1.0, 2.0]}, step=0)


def test_table_row_of_wrong_width_is_refused(tmp_path):
    sink = MultiSink([JsonlSink(tmp_path / METRICS_FILE), ExpertLoadSink(store_path(tmp_path))])
    with pytest.raises(ValueError, match=r"row 1 .*4 values \['layer', 'expert'"):
        sink.log({mn.EXPERT_LOADS: [[0, 0, 5, 50.0], [0, 1, 5]]}, step=0)


def test_nan_in_a_table_cell_is_refused_before_any_sink_writes(tmp_path):
    sink = MultiSink([JsonlSink(tmp_path / METRICS_FILE), ExpertLoadSink(store_path(tmp_path))])
    with pytest.raises(ValueError, match=r"row 0 column 'load_percent' is nan.*not NaN"):
        sink.log({mn.EXPERT_LOADS: [[0, 0, 0, math.nan]]}, step=0)
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_negative_step_is_refused(tmp_path):
    sink = MultiSink([JsonlSink(tmp_path / METRICS_FILE)])
    with pytest.raises(ValueError, match="non-negative int"):
        sink.log({mn.TOKENS: 1}, step=-1)


class _BrokenSink:
    """A backend whose every call fails, as a full disk or a dead service would."""

    calls = 0

    def log(self, metrics, step):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        raise OSError("disk full")


def test_a_failing_sink_warns_once_and_the_others_keep_every_step(tmp_path):
    broken = _BrokenSink()
    sink = MultiSink([broken, JsonlSink(tmp_path / METRICS_FILE)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            sink.log({mn.TOKENS: step}, step)
        sink.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "_BrokenSink.log failed (OSError: disk full)" in messages[0]
    assert broken.calls == 3
    assert [r["step"] for r in jsonl_lines(tmp_path / METRICS_FILE)] == [0, 1, 2]


def test_split_tables_separates_the_expert_table_from_scalars():
    from nemo_moe_metrics.sinks import split_tables

    table = [[0, 0, 3, 75.0], [0, 1, 1, 25.0]]
    scalars, tables = split_tables(
        {"moe/expert_loads": table, "moe/max_over_ideal": 1.5, "train_perf/tokens": 4.0}
    )
    assert scalars == {"moe/max_over_ideal": 1.5, "train_perf/tokens": 4.0}
    assert tables == {"moe/expert_loads": table}


def test_off_cadence_tables_are_not_checked_when_no_sink_wants_them(tmp_path):
    # A malformed table on a step no sink takes tables: dropped, not validated, not an error.
    sink = build_sinks(JSONL_ONLY.model_copy(update={"table_every": 2}), tmp_path, run_name="r")
    sink.log({mn.TOKENS: 1, mn.EXPERT_LOADS: [["bad row"]]}, step=1)
    with pytest.raises(ValueError, match="row 0"):
        sink.log({mn.TOKENS: 2, mn.EXPERT_LOADS: [["bad row"]]}, step=2)
    sink.close()
    assert [r["step"] for r in jsonl_lines(tmp_path / METRICS_FILE)] == [1]


def test_a_sink_without_wants_tables_still_gets_every_table(tmp_path):
    seen = []

    class Plain:
        def log(self, metrics, step):
            seen.append((step, mn.EXPERT_LOADS in metrics))

        def close(self):
            pass

    sink = MultiSink([Plain()])
    sink.log({mn.EXPERT_LOADS: [[0, 0, 1, 100.0]]}, step=3)
    assert seen == [(3, True)]
