"""StepMeter on one process: arithmetic, failed and empty steps, the event path, no per-microbatch
sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from throughput_helpers import TOY_ATTN, TOY_PARAMS, FakeClock, FakeStream, toy_flops
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.throughput import (
    StepMeter,
    lengths_from_attention_mask,
    perf_metrics,
)

aten = torch.ops.aten


def _toy(lens: list[int]) -> float:
    """The toy FLOP count by hand: 6 P per token + 12 D per causal (q, k) pair."""
    return float(sum(6 * TOY_PARAMS * n + 12 * TOY_ATTN * n * (n + 1) // 2 for n in lens))


def lens_tensor(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _clocked(**kwargs) -> tuple[StepMeter, FakeClock]:
    clock = FakeClock()
    return StepMeter(clock=clock, **kwargs), clock


# --- pure arithmetic --------------------------------------------------------------------------


def test_perf_metrics_rates_are_ratios_of_sums():
    out = perf_metrics(
        tokens=300,
        seconds=4.0,
        total_tokens=900,
        total_seconds=10.0,
        flops=8e15,
        total_flops=2e16,
        world_size=4,
        peak_flops_per_gpu=1e15,
    )
    assert out == {
        mn.TOKENS: 300.0,
        mn.SECONDS: 4.0,
        mn.TOTAL_TOKENS: 900.0,
        mn.TOTAL_SECONDS: 10.0,
        mn.TOKENS_PER_SECOND: 75.0,
        mn.CUMULATIVE_TOKENS_PER_SECOND: 90.0,
        mn.ESTIMATED_FLOPS: 8e15,
        mn.ESTIMATED_FLOPS_PER_SECOND: 2e15,
        mn.TFLOPS_PER_GPU: 500.0,  # 2e15 / 4 / 1e12
        mn.MFU: 0.5,  # 2e15 / 4 / 1e15
        mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND: 2e15,
    }


def test_perf_metrics_zero_seconds_leaves_rates_out():
    out = perf_metrics(
        tokens=0, seconds=0.0, total_tokens=0, total_seconds=0.0, flops=0.0, total_flops=0.0
    )
    assert set(out) == {
        mn.TOKENS,
        mn.SECONDS,
        mn.TOTAL_TOKENS,
        mn.TOTAL_SECONDS,
        mn.ESTIMATED_FLOPS,
    }


def test_perf_metrics_rejects_negative_seconds():
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        perf_metrics(tokens=1, seconds=-1.0, total_tokens=1, total_seconds=1.0)


# --- the meter on the host clock ---------------------------------------------------------------


def test_interval_then_cumulative_match_hand_arithmetic():
    meter, clock = _clocked(flops_estimator=toy_flops)
    with meter.step():
        meter.add_sequences(lens_tensor(5, 7))
        meter.add_sequences(lens_tensor(3))
        clock.advance(1.5)
    with meter.step():
        meter.add_sequences(lens_tensor(10))
        clock.advance(0.5)
    clock.advance(30.0)  # time between steps is not step time
    first = meter.export()
    assert first[mn.TOKENS] == 25
    assert first[mn.SECONDS] == pytest.approx(2.0)
    assert first[mn.TOKENS_PER_SECOND] == pytest.approx(25 / 2.0)  # not mean(15/1.5, 10/0.5)
    assert first[mn.ESTIMATED_FLOPS] == _toy([5, 7, 3, 10])

    with meter.step():
        meter.add_sequences(lens_tensor(20, 15))
        clock.advance(3.0)
    second = meter.export()
    assert second[mn.TOKENS] == 35
    assert second[mn.SECONDS] == pytest.approx(3.0)
    assert second[mn.TOTAL_TOKENS] == 60
    assert second[mn.TOTAL_SECONDS] == pytest.approx(5.0)
    assert second[mn.CUMULATIVE_TOKENS_PER_SECOND] == pytest.approx(60 / 5.0)
    assert second[mn.ESTIMATED_FLOPS_PER_SECOND] == pytest.approx(_toy([20, 15]) / 3.0)
    assert second[mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND] == pytest.approx(
        _toy([5, 7, 3, 10, 20, 15]) / 5.0
    )


def test_failed_step_is_not_counted():
    meter, clock = _clocked()
    with meter.step():
        meter.add_sequences(lens_tensor(4, 4))
        clock.advance(1.0)
    with pytest.raises(ZeroDivisionError), meter.step():
        meter.add_sequences(lens_tensor(100))
        clock.advance(50.0)
        _ = 1 / 0
    out = meter.export()
    assert out[mn.TOKENS] == 8
    assert out[mn.SECONDS] == pytest.approx(1.0)
    assert (meter.steps, meter.failed_steps) == (1, 1)


def test_zero_token_step_gives_zero_rates_without_division_error():
    meter, clock = _clocked(flops_estimator=toy_flops, peak_flops_per_gpu=1e12)
    with meter.step():
        meter.add_sequences(lens_tensor(0, 0))
        clock.advance(2.0)
    out = meter.export()
    assert out[mn.TOKENS] == 0
    assert out[mn.TOKENS_PER_SECOND] == 0.0
    assert out[mn.ESTIMATED_FLOPS] == 0.0
    assert out[mn.MFU] == 0.0


def test_export_without_steps_leaves_rates_out():
    meter, _ = _clocked(flops_estimator=toy_flops)
    out = meter.export()
    assert out[mn.SECONDS] == 0.0 and out[mn.TOKENS] == 0.0
    for key in (
        mn.TOKENS_PER_SECOND,
        mn.CUMULATIVE_TOKENS_PER_SECOND,
        mn.ESTIMATED_FLOPS_PER_SECOND,
        mn.TFLOPS_PER_GPU,
    ):
        assert key not in out


def test_zero_second_step_leaves_interval_rates_out():
    meter, _ = _clocked()
    with meter.step():  # the clock does not move
        meter.add_sequences(lens_tensor(3))
    out = meter.export()
    assert out[mn.TOKENS] == 3
    assert mn.TOKENS_PER_SECOND not in out


def test_mfu_absent_on_cpu_without_peak():
    meter = StepMeter(flops_estimator=toy_flops, device=torch.device("cpu"))
    with meter.step():
        meter.add_sequences(lens_tensor(8))
    out = meter.export()
    assert mn.MFU not in out
    assert {mn.ESTIMATED_FLOPS, mn.TFLOPS_PER_GPU} <= set(out)


def test_mfu_with_configured_peak():
    meter, clock = _clocked(flops_estimator=toy_flops, peak_flops_per_gpu=2e6, world_size=4)
    with meter.step():
        meter.add_sequences(lens_tensor(16, 32))
        clock.advance(0.25)
    out = meter.export()
    per_gpu = _toy([16, 32]) / 0.25 / 4
    assert out[mn.MFU] == pytest.approx(per_gpu / 2e6)
    assert out[mn.TFLOPS_PER_GPU] == pytest.approx(per_gpu / 1e12)


def test_mfu_above_one_warns():
    meter, clock = _clocked(flops_estimator=toy_flops, peak_flops_per_gpu=1.0)
    with meter.step():
        meter.add_sequences(lens_tensor(8))
        clock.advance(1.0)
    with pytest.warns(RuntimeWarning, match="mfu"):
        meter.export()


def test_no_flop_keys_without_estimator():
    meter, clock = _clocked()
    with meter.step():
        meter.add_sequences(lens_tensor(8))
        clock.advance(1.0)
    assert set(meter.export()) == set(mn.THROUGHPUT_KEYS)


def test_estimator_gets_int64_lengths_of_the_interval_once():
    calls = []

    def recording(lens, causal=True):
        calls.append((str(lens.dtype), lens.tolist(), causal))
        return toy_flops(lens, causal)

    meter, _ = _clocked(flops_estimator=recording, causal=False)
    for lens in ([3, 4], [5]):
        with meter.step():
            meter.add_sequences(lens_tensor(*lens))
    meter.export()
    assert calls == [("int64", [3, 4, 5], False)]


def test_reused_length_buffer_does_not_change_counts():
    meter, _ = _clocked()
    buffer = lens_tensor(6, 6)
    with meter.step():
        meter.add_sequences(buffer)
        buffer.fill_(1000)  # the caller reuses its buffer for the next microbatch
    assert meter.export()[mn.TOKENS] == 12


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.tensor([1.0, 2.0]), TypeError, "integer token counts"),
        (torch.tensor([True]), TypeError, "integer token counts"),
        (torch.ones(2, 3, dtype=torch.int64), ValueError, "one length per sequence"),
        ([1, 2], TypeError, "pass a tensor"),
        (torch.ones(2, dtype=torch.int64, device="meta"), ValueError, "host clock"),
    ],
)
def test_add_sequences_rejects_bad_input(value, error, match):
    meter = StepMeter()
    with pytest.raises(error, match=match), meter.step():
        meter.add_sequences(value)


def test_add_sequences_outside_step_is_an_error():
    with pytest.raises(RuntimeError, match="inside `with meter.step"):
        StepMeter().add_sequences(lens_tensor(1))


def test_steps_do_not_nest():
    meter = StepMeter()
    with pytest.raises(RuntimeError, match="do not nest"), meter.step(), meter.step():
        pass


def test_export_inside_step_is_an_error():
    meter = StepMeter()
    with pytest.raises(RuntimeError, match="after the step"), meter.step():
        meter.export()


def test_negative_length_is_reported_at_export():
    meter = StepMeter()
    with meter.step():
        meter.add_sequences(lens_tensor(3, -2))
    with pytest.raises(ValueError, match="lengths must be >= 0; got -2"):
        meter.export()


def test_peak_needs_an_estimator():
    with pytest.raises(ValueError, match="pass a flops_estimator"):
        StepMeter(peak_flops_per_gpu=1e15)


def test_peak_must_be_positive():
    with pytest.raises(ValueError, match="positive FLOP/s"):
        StepMeter(flops_estimator=toy_flops, peak_flops_per_gpu=0.0)


# --- no host-device synchronisation per microbatch ----------------------------------------------


class NoHostSync(TorchDispatchMode):
    """Raises on any op that makes the host wait for a device value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.item.default):
            raise AssertionError(f"host sync: {func}")
        src = args[0] if args else None
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            to_host = target is not None and torch.device(target).type == "cpu"
            if to_host and src.device.type != "cpu":
                raise AssertionError(f"device-to-host copy: {func}")
        if func is aten.copy_.default and src.device.type == "cpu" and args[1].device.type != "cpu":
            raise AssertionError(f"device-to-host copy: {func}")
        return func(*args, **kwargs)


def test_sync_guard_catches_item():
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        torch.tensor([3]).sum().item()


@pytest.mark.parametrize("path", ["events", "host clock"])
def test_step_and_add_sequences_make_no_host_sync(path):
    stream = FakeStream()
    meter = StepMeter(event_factory=stream.event) if path == "events" else StepMeter()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with NoHostSync():
        for _ in range(2):
            with meter.step():
                for _ in range(3):
                    meter.add_sequences(lengths_from_attention_mask(mask))
                    meter.add_sequences(mask.sum(-1))
    assert meter.export()[mn.TOKENS] == 2 * 3 * 10


def test_add_sequences_reads_no_values():
    # Meta tensors have no data: any attempt to read a value would fail.
    meter = StepMeter(event_factory=FakeStream().event)
    with meter.step():
        meter.add_sequences(torch.empty(4, dtype=torch.int64, device="meta"))
    assert meter.steps == 1


# --- docs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_docs_describe_every_train_perf_key(lang):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / lang / "throughput.md").read_text()
    missing = [k for k in (*mn.THROUGHPUT_KEYS, *mn.FLOPS_KEYS) if f"`{k}`" not in text]
    assert not missing, f"docs/{lang}/throughput.md lacks {missing}"


# --- bookkeeping over many exports ---------------------------------------------------------------


_step = st.tuples(st.lists(st.integers(0, 64), max_size=4), st.integers(0, 4))  # lens, quarter-s

_interval = st.lists(_step, max_size=3)


@settings(max_examples=40, deadline=None)
@given(st.lists(_interval, min_size=1, max_size=4))
def test_every_export_is_a_ratio_of_sums(intervals):
    meter, clock = _clocked()
    seen_tokens, seen_seconds = 0, 0.0
    for steps in intervals:
        for lens, quarters in steps:
            with meter.step():
                if lens:
                    meter.add_sequences(lens_tensor(*lens))
                clock.advance(quarters / 4)  # exact binary fractions: sums compare exactly
        out = meter.export()
        tokens = sum(sum(lens) for lens, _ in steps)
        seconds = sum(q / 4 for _, q in steps)
        seen_tokens, seen_seconds = seen_tokens + tokens, seen_seconds + seconds
        assert (out[mn.TOKENS], out[mn.SECONDS]) == (tokens, seconds)
        assert (out[mn.TOTAL_TOKENS], out[mn.TOTAL_SECONDS]) == (seen_tokens, seen_seconds)
        assert out.get(mn.TOKENS_PER_SECOND) == (tokens / seconds if seconds else None)
        expected_cumulative = seen_tokens / seen_seconds if seen_seconds else None
        assert out.get(mn.CUMULATIVE_TOKENS_PER_SECOND) == expected_cumulative


# --- FLOPs from device sums: the lengths never travel to the host ------------------------------


@pytest.mark.parametrize("fixture", ["gpt-oss-120b", "qwen3-30b-a3b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("causal", [True, False])
def test_device_sums_give_the_estimators_own_flops_exactly(fixture, causal):
    import numpy as np

    from nemo_moe_metrics.flops import get_flops_estimator, load_fixture

    est = get_flops_estimator(load_fixture(fixture))
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 9000, size=n) for n in (3, 1, 5)]
    meter = StepMeter(flops_estimator=est, causal=causal)
    with meter.step():
        for lens in batches:
            meter.add_sequences(torch.tensor(lens))
    out = meter.export()
    expected = est(np.concatenate(batches), causal=causal).total  # the host formula
    assert out[mn.ESTIMATED_FLOPS] == expected
    assert out[mn.TOKENS] == float(np.concatenate(batches).sum())


@pytest.mark.parametrize("with_estimator", [False, True])
def test_microbatch_without_sequences_adds_nothing(with_estimator):
    import numpy as np

    from nemo_moe_metrics.flops import get_flops_estimator, load_fixture

    est = get_flops_estimator(load_fixture("gpt-oss-120b")) if with_estimator else None
    meter = StepMeter(flops_estimator=est)
    with meter.step():
        meter.add_sequences(torch.zeros(0, dtype=torch.int64))
        meter.add_sequences(torch.tensor([4, 6]))
    out = meter.export()
    assert out[mn.TOKENS] == 10
    if est is not None:
        assert out[mn.ESTIMATED_FLOPS] == est(np.array([4, 6])).total
    with meter.step():  # a step whose only microbatch is empty: zero tokens, not an error
        meter.add_sequences(torch.zeros(0, dtype=torch.int64))
    assert meter.export()[mn.TOKENS] == 0


def test_export_with_a_registered_estimator_reads_the_host_once():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.host_reads import HostReadCounter
    from nemo_moe_metrics.flops import get_flops_estimator, load_fixture

    meter = StepMeter(flops_estimator=get_flops_estimator(load_fixture("gpt-oss-120b")))
    with meter.step():
        meter.add_sequences(torch.tensor([5, 7000]))
    with HostReadCounter() as counter:
        meter.export()
    assert counter.total == 1, counter.by_site
