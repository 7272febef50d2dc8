"""FLOP arithmetic (flops/core.py): attention pairs per sequence (causal, full, windows), packed
batches as sums of sequences, components adding up, input validated at the boundary, and
properties over random batches."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_moe_metrics.flops import (
    FlopsBreakdown,
    get_flops_estimator,
    load_fixture,
)
from nemo_moe_metrics.flops.core import (
    ChunkedWindow,
    CompressedWindow,
    PooledWindow,
    pairs_per_sequence,
)

pytestmark = pytest.mark.megatron

H, HEADS, KV, HD, FFN, V = 64, 4, 2, 24, 96, 128


def llama_config(**extra):
    return {
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "vocab_size": V,
        **extra,
    }


def brute_pairs(n, window=None):
    return sum(min(i + 1, window) if window else i + 1 for i in range(n))


# --- attention accounting -------------------------------------------------------------


def test_causal_core_counts_attended_pairs_per_sequence():
    lengths = [1, 7, 40]
    got = get_flops_estimator(llama_config())(lengths, causal=True).by_component["attention_core"]
    pairs = sum(brute_pairs(n) for n in lengths)
    assert got == 3 * 2 * 2 * HEADS * (HD + HD) * pairs


def test_noncausal_core_counts_full_square_per_sequence():
    lengths = [3, 9]
    got = get_flops_estimator(llama_config())(lengths, causal=False).by_component["attention_core"]
    assert got == 3 * 2 * 2 * HEADS * 2 * HD * (9 + 81)


def test_sliding_window_counts_only_pairs_inside_window():
    est = get_flops_estimator(llama_config(model_type="mistral", sliding_window=5))
    lengths = [3, 5, 6, 23]
    got = est(lengths).by_component["attention_core"]
    pairs = sum(brute_pairs(n, window=5) for n in lengths)
    assert got == 3 * 2 * 2 * HEADS * 2 * HD * pairs


def _visible_keys(i: int, window) -> int:
    """Keys query i (0-based) sees, counted one by one from the rule in words."""
    if isinstance(window, ChunkedWindow):  # its own chunk, up to itself
        return sum(1 for j in range(i + 1) if j // window.size == i // window.size)
    if isinstance(window, CompressedWindow):  # entries of complete blocks up to it, top keep
        entries = sum(1 for block_end in range(window.rate, i + 2, window.rate))
        return entries if window.keep is None else min(entries, window.keep)
    if isinstance(window, PooledWindow):  # up to keep // pool complete pools, then its tail
        pools = [range(s, s + window.pool) for s in range(0, i + 1 - window.pool + 1, window.pool)]
        kept = sum(len(p) for p in pools[: window.keep // window.pool])
        tail = (i + 1) - len(pools) * window.pool  # keys after the last complete pool
        return kept + (tail if window.tail else 0)
    return min(i + 1, window)


@pytest.mark.parametrize(
    "window",
    [
        ChunkedWindow(4),
        ChunkedWindow(1),
        CompressedWindow(4),
        CompressedWindow(3, keep=2),
        PooledWindow(4, keep=8),
        PooledWindow(3, keep=6, tail=False),
        PooledWindow(1, keep=5),
        6,
    ],
)
def test_every_window_kind_counts_the_keys_each_query_sees(window):
    import torch

    lengths = np.arange(0, 30)
    causal = [sum(_visible_keys(i, window) for i in range(n)) for n in lengths]
    assert list(pairs_per_sequence(lengths, causal=True, window=window)) == causal
    # The device-side sums (throughput) use the same function on integer tensors.
    on_device = pairs_per_sequence(torch.tensor(lengths), causal=True, window=window)
    assert on_device.tolist() == causal
    full = [
        n * (n // window.rate) if isinstance(window, CompressedWindow) else n * n for n in lengths
    ]
    assert list(pairs_per_sequence(lengths, causal=False, window=window)) == full


def test_causal_flag_changes_only_attention_core():
    est = get_flops_estimator(load_fixture("qwen3-30b-a3b"))
    causal, full = est([300, 41]), est([300, 41], causal=False)
    for key in causal.by_component:
        if key == "attention_core":
            assert causal.by_component[key] < full.by_component[key]
        else:
            assert causal.by_component[key] == full.by_component[key]


def test_packed_batch_is_sum_of_its_sequences_not_one_long_sequence():
    est = get_flops_estimator(load_fixture("llama-3.1-8b"))
    packed = est([1000, 3000]).total
    assert packed == pytest.approx(est([1000]).total + est([3000]).total, rel=1e-12)
    assert packed < est([4000]).total


def test_total_is_sum_of_components():
    out = get_flops_estimator(load_fixture("qwen3-next-80b-a3b"))([4096, 17])
    assert isinstance(out, FlopsBreakdown)
    assert out.total == pytest.approx(sum(out.by_component.values()), rel=1e-12)


# --- input validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([4, -1], ValueError, r"seq_lens\[1\] = -1 is negative"),
        ([4, 2.5], TypeError, r"seq_lens\[1\] = 2.5 is not an integer"),
        ([True], TypeError, "not an integer"),
        (np.array([1.0, 2.0]), TypeError, "dtype float64"),
        (np.ones((2, 2), dtype=np.int64), ValueError, "must be 1-D"),
        (4096, TypeError, r"pass \[4096\]"),
        ("4096", TypeError, "must be a list"),
    ],
)
def test_bad_seq_lens_raise_clear_errors(bad, error, message):
    with pytest.raises(error, match=message):
        get_flops_estimator(llama_config())(bad)


def test_empty_batch_is_zero():
    out = get_flops_estimator(llama_config())([])
    assert out.total == 0.0
    assert set(out.by_component.values()) == {0.0}


def test_numpy_and_torch_lengths_match_lists():
    torch = pytest.importorskip("torch")
    est = get_flops_estimator(llama_config())
    expected = est([5, 9]).total
    assert est(np.array([5, 9], dtype=np.int32)).total == expected
    assert est(torch.tensor([5, 9])).total == expected


def test_million_token_sequences_do_not_overflow():
    est = get_flops_estimator(llama_config())
    n = 1_000_000
    # int32 input: n * n would wrap around in the input's own dtype.
    got = est(np.full(8, n, dtype=np.int32), causal=False).by_component["attention_core"]
    exact = 3 * 2 * 2 * HEADS * 2 * HD * 8 * n * n  # 2 layers; Python ints: exact
    assert got == pytest.approx(exact, rel=1e-12)


def test_large_batch_is_vectorised():
    est = get_flops_estimator(load_fixture("gpt-oss-120b"))
    lengths = np.random.default_rng(0).integers(1, 8192, size=200_000)
    start = time.perf_counter()
    total = est(lengths).total
    elapsed = time.perf_counter() - start
    sample = est(lengths[:3]).total
    assert sample == pytest.approx(sum(est([int(n)]).total for n in lengths[:3]), rel=1e-12)
    assert total > 0 and elapsed < 1.0, elapsed


# --- properties ---------------------------------------------------------------------------


_lengths = st.lists(st.integers(min_value=0, max_value=70_000), max_size=20)

_GPT_OSS = get_flops_estimator(load_fixture("gpt-oss-120b"))


@settings(max_examples=60, deadline=None)
@given(a=_lengths, b=_lengths)
def test_batches_add_up_sequence_by_sequence(a, b):
    for causal in (True, False):
        joined = _GPT_OSS(a + b, causal=causal).total
        split = _GPT_OSS(a, causal=causal).total + _GPT_OSS(b, causal=causal).total
        assert joined == pytest.approx(split, rel=1e-12, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(lengths=_lengths)
def test_causal_never_exceeds_full_and_window_never_exceeds_causal(lengths):
    causal = _GPT_OSS(lengths).by_component["attention_core"]
    full = _GPT_OSS(lengths, causal=False).by_component["attention_core"]
    unwindowed = get_flops_estimator(
        {**load_fixture("gpt-oss-120b"), "layer_types": ["full_attention"] * 36}
    )(lengths).by_component["attention_core"]
    assert causal <= unwindowed <= full
