"""StepMeter across two real gloo ranks: sums, maxima, interval vs cumulative, CP, bad input,
Megatron.

One spawn runs every scenario in order (ranks cost seconds to start); each test reads its part.
"""

from __future__ import annotations

import time

import pytest
from dist import ok_values, run_ranks
from throughput_helpers import TOY_ATTN, TOY_PARAMS

from nemo_moe_metrics.export import metric_names as mn

pytestmark = pytest.mark.megatron

PEAK = 1e9  # a configured peak FLOP/s per GPU (small, so the toy model gives a readable MFU)

# Per rank: steps of the first, second and third interval as (microbatch lengths, seconds).
INTERVALS = {
    0: [
        [([5, 7], 1.0), ([10, 3], 3.0)],
        [([4], 0.5)],
        [([0], 1.0)],  # a zero-token step
    ],
    1: [
        [([2, 2, 2], 2.0), ([6, 1], 1.0)],
        [([8, 8], 2.5)],
        [],  # this rank's only step fails (below)
    ],
}
SLEEP = {0: (100, 0.05), 1: (300, 0.25)}  # tokens, seconds slept in one real step
CP_LENS = [10, 20]


def _toy(lens: list[int]) -> float:
    return float(sum(6 * TOY_PARAMS * n + 12 * TOY_ATTN * n * (n + 1) // 2 for n in lens))


def _capture(fn):
    try:
        return ("ok", fn())
    except Exception as err:  # noqa: BLE001 - the test inspects which rank raised what
        return (type(err).__name__, str(err))


def _scenarios(rank, world_size):
    import torch
    import torch.distributed as dist
    from throughput_helpers import FakeClock, toy_flops

    from nemo_moe_metrics.throughput import StepMeter

    dist.init_process_group("gloo")
    out = {}

    # 1. Exact arithmetic with a scripted clock: three exports.
    clock = FakeClock()
    meter = StepMeter(flops_estimator=toy_flops, peak_flops_per_gpu=PEAK, clock=clock)
    exports = []
    for i, steps in enumerate(INTERVALS[rank]):
        for lens, seconds in steps:
            with meter.step():
                for n in lens:  # one microbatch per sequence
                    meter.add_sequences(torch.tensor([n]))
                clock.advance(seconds)
        if i == 2 and rank == 1:
            try:
                with meter.step():
                    meter.add_sequences(torch.tensor([9]))
                    clock.advance(5.0)
                    raise RuntimeError("optimizer step failed")
            except RuntimeError:
                pass
        exports.append(meter.export())
    out["exports"] = exports

    # 2. Real wall clock with sleeps of different lengths.
    tokens, nap = SLEEP[rank]
    meter = StepMeter()
    outer = time.perf_counter()
    with meter.step():
        meter.add_sequences(torch.tensor([tokens]))
        time.sleep(nap)
    outer = time.perf_counter() - outer
    out["sleep"] = (meter.export(), outer)

    # 3. Bad input on rank 0 only: every rank raises, none hangs.
    meter = StepMeter()
    with meter.step():
        meter.add_sequences(torch.tensor([-1 if rank == 0 else 5]))
    out["bad"] = _capture(meter.export)

    # 3b. Device-event timing (a stand-in stream): one wait per export; the step seconds' MAX
    # goes over a host (gloo) group, or over the timing group when none is given.
    from throughput_helpers import FakeStream

    for label, host_group in (("host_group", dist.new_group(backend="gloo")), ("plain", None)):
        stream = FakeStream()
        meter = StepMeter(event_factory=stream.event, host_timing_group=host_group)
        with meter.step():
            meter.add_sequences(torch.tensor([4 + rank]))
            stream.run(3.0 + 2.0 * rank)  # rank 0: 3 ms, rank 1: 5 ms
        out[f"events_{label}"] = (meter.export(), stream.synchronizations)

    # 4. Context parallel 2 with megatron-core's own process groups.
    from megatron.core import parallel_state

    from nemo_moe_metrics.config import MegatronConfig
    from nemo_moe_metrics.megatron.model import init_distributed

    init_distributed(MegatronConfig(context_parallel_size=2))

    def cp_export(lens):
        clock = FakeClock()
        meter = StepMeter(
            flops_estimator=toy_flops,
            clock=clock,
            data_group=parallel_state.get_data_parallel_group(with_context_parallel=False),
            context_parallel_group=parallel_state.get_context_parallel_group(),
        )
        with meter.step():
            meter.add_sequences(torch.tensor(lens))
            clock.advance(2.0)
        return meter.export()

    out["cp"] = _capture(lambda: cp_export(CP_LENS))
    out["cp_mismatch"] = _capture(lambda: cp_export(CP_LENS if rank == 0 else CP_LENS[:1]))

    # 5. A real megatron-core MoE model, data parallel 2 (expert parallel 2), padded batches.
    out["megatron"] = _train_megatron(rank)
    return out


def _train_megatron(rank):
    import torch
    from megatron.core import parallel_state
    from throughput_helpers import toy_flops

    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.throughput import StepMeter, lengths_from_attention_mask

    megatron_cfg = MegatronConfig(expert_model_parallel_size=2)
    init_distributed(megatron_cfg)
    model_cfg = ModelConfig(num_layers=2, seq_length=16)
    model = build_gpt_model(model_cfg, megatron_cfg)
    s = model_cfg.seq_length
    meter = StepMeter(
        flops_estimator=toy_flops, data_group=parallel_state.get_data_parallel_group()
    )
    generator = torch.Generator().manual_seed(7 + rank)
    real_lengths = []
    with meter.step():
        for _ in range(2):  # microbatches of 2 padded sequences
            lens = torch.randint(4, s + 1, (2,), generator=generator)
            real_lengths += [int(n) for n in lens]
            padding_mask = (torch.arange(s)[None, :] < lens[:, None]).to(torch.int64)
            tokens = torch.randint(0, model_cfg.vocab_size, (2, s), generator=generator)
            position_ids = torch.arange(s).expand(2, s)
            loss = model(tokens, position_ids, causal_attention_mask(s), labels=tokens)
            (loss * padding_mask).sum().backward()
            meter.add_sequences(lengths_from_attention_mask(padding_mask))
    return {"export": meter.export(), "real_lengths": real_lengths}


@pytest.fixture(scope="module")
def ranks():
    return ok_values(run_ranks(_scenarios, 2, timeout=150))


def _expected_interval(i):
    lens = {r: [n for lens_, _ in INTERVALS[r][i] for n in lens_] for r in (0, 1)}
    seconds = {r: sum(sec for _, sec in INTERVALS[r][i]) for r in (0, 1)}
    tokens = sum(sum(v) for v in lens.values())
    flops = sum(_toy(v) for v in lens.values())
    return tokens, max(seconds.values()), flops


def test_tokens_sum_and_seconds_take_the_max_over_ranks(ranks):
    first = ranks[0]["exports"][0]
    # rank 0: 25 tokens in 1 + 3 = 4 s; rank 1: 13 tokens in 2 + 1 = 3 s.
    assert first[mn.TOKENS] == 38
    assert first[mn.SECONDS] == pytest.approx(4.0)
    assert first[mn.TOKENS_PER_SECOND] == pytest.approx(38 / 4.0)


@pytest.mark.parametrize("label", ["host_group", "plain"])
def test_event_timed_seconds_take_the_max_over_ranks_with_one_wait(ranks, label):
    for rank in (0, 1):
        metrics, waits = ranks[rank][f"events_{label}"]
        assert metrics[mn.SECONDS] == pytest.approx(0.005)  # the slower rank's 5 ms
        assert metrics[mn.TOKENS] == 4 + 5
        assert waits == 1


def test_every_rank_exports_the_same_values(ranks):
    assert ranks[0]["exports"] == ranks[1]["exports"]


def test_flops_sum_over_ranks_and_per_gpu_rates(ranks):
    first = ranks[0]["exports"][0]
    flops = _toy([5, 7, 10, 3]) + _toy([2, 2, 2, 6, 1])
    assert first[mn.ESTIMATED_FLOPS] == pytest.approx(flops)
    assert first[mn.ESTIMATED_FLOPS_PER_SECOND] == pytest.approx(flops / 4.0)
    assert first[mn.TFLOPS_PER_GPU] == pytest.approx(flops / 4.0 / 2 / 1e12)
    assert first[mn.MFU] == pytest.approx(flops / 4.0 / 2 / PEAK)


def test_second_export_gives_interval_and_cumulative_values(ranks):
    second = ranks[0]["exports"][1]
    # Interval: 4 + 16 = 20 tokens, max(0.5, 2.5) = 2.5 s. Cumulative: 58 tokens in 4 + 2.5 s.
    assert second[mn.TOKENS] == 20
    assert second[mn.SECONDS] == pytest.approx(2.5)
    assert second[mn.TOKENS_PER_SECOND] == pytest.approx(8.0)
    assert second[mn.TOTAL_TOKENS] == 58
    assert second[mn.TOTAL_SECONDS] == pytest.approx(6.5)
    assert second[mn.CUMULATIVE_TOKENS_PER_SECOND] == pytest.approx(58 / 6.5)
    total_flops = sum(_expected_interval(i)[2] for i in (0, 1))
    assert second[mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND] == pytest.approx(total_flops / 6.5)


def test_failed_and_zero_token_steps_across_ranks(ranks):
    third = ranks[0]["exports"][2]
    # Rank 0: one zero-token step of 1 s; rank 1: its only step failed and is not counted.
    assert third[mn.TOKENS] == 0
    assert third[mn.SECONDS] == pytest.approx(1.0)
    assert third[mn.TOKENS_PER_SECOND] == 0.0
    assert third[mn.MFU] == 0.0
    assert third[mn.TOTAL_TOKENS] == 58
    assert third[mn.TOTAL_SECONDS] == pytest.approx(7.5)


def test_wall_clock_seconds_are_the_slowest_ranks_step(ranks):
    (out0, outer0), (out1, outer1) = ranks[0]["sleep"], ranks[1]["sleep"]
    assert out0 == out1
    assert out0[mn.TOKENS] == 400
    # Rank 1 slept 0.25 s inside its step; no step lasted longer than its outer bracket.
    assert SLEEP[1][1] <= out0[mn.SECONDS] <= max(outer0, outer1)
    assert out0[mn.TOKENS_PER_SECOND] == pytest.approx(400 / out0[mn.SECONDS])


def test_bad_input_on_one_rank_raises_on_every_rank(ranks):
    assert ranks[0]["bad"][0] == "ValueError" and "lengths must be >= 0" in ranks[0]["bad"][1]
    assert ranks[1]["bad"][0] == "RuntimeError" and "another rank" in ranks[1]["bad"][1]


def test_context_parallel_sequence_counts_once(ranks):
    for r in (0, 1):
        status, out = ranks[r]["cp"]
        assert status == "ok", out
        assert out[mn.TOKENS] == sum(CP_LENS)  # not 2 x: both CP ranks hold the same sequences
        assert out[mn.ESTIMATED_FLOPS] == pytest.approx(_toy(CP_LENS))
        # The two CP ranks share the sequence's work: per GPU is half the FLOP/s.
        assert out[mn.TFLOPS_PER_GPU] == pytest.approx(_toy(CP_LENS) / 2.0 / 2 / 1e12)


def test_context_parallel_length_mismatch_raises_on_every_rank(ranks):
    for r in (0, 1):
        status, message = ranks[r]["cp_mismatch"]
        assert status == "ValueError"
        assert "full (unsplit) lengths" in message


def test_megatron_data_parallel_counts_real_tokens_of_both_ranks(ranks):
    real = ranks[0]["megatron"]["real_lengths"] + ranks[1]["megatron"]["real_lengths"]
    out = ranks[0]["megatron"]["export"]
    assert out[mn.TOKENS] == sum(real)
    assert out[mn.TOKENS] < 2 * 4 * 16  # padding is not counted
    assert out[mn.ESTIMATED_FLOPS] == pytest.approx(
        _toy(ranks[0]["megatron"]["real_lengths"]) + _toy(ranks[1]["megatron"]["real_lengths"])
    )
    assert out[mn.SECONDS] > 0
