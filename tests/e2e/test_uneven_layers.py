"""A model whose MoE layers differ (4 experts top-1 next to 8 experts top-2), end to end.

The model is a user's own transformers model (its own ``PretrainedConfig`` subclass), with no
entry anywhere in this package: its experts follow transformers' experts interface
(``experts(hidden_states, top_k_index, top_k_weights)``), which is all ``attach`` needs. The
counts, balance statistics, table, expert-load store and report follow each layer's own expert
count and top-k; expected values come from the routing the test itself chose.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from matplotlib.image import imread  # noqa: E402
from torch import nn  # noqa: E402

from nemo_moe_metrics.config import LoggerConfig, MetricsConfig  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.moe.load_over_steps import DeadStreaks  # noqa: E402
from nemo_moe_metrics.report import HEATMAP_FILE, OVER_STEPS_FILE, render_report  # noqa: E402
from nemo_moe_metrics.report.timeline import prepare_block  # noqa: E402
from nemo_moe_metrics.sinks import build_sinks  # noqa: E402
from nemo_moe_metrics.sinks.store import (  # noqa: E402
    ExpertLoadStore,
    StoreError,
    read_expert_load_blocks,
    read_expert_loads,
    scan_store,
    store_path,
    table_to_counts_and_widths,
)
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics  # noqa: E402

pytestmark = pytest.mark.one_line
HIDDEN, TOKENS = 16, 24
LAYERS = ((4, 1), (8, 2))  # (experts, top-k) per layer


class UnevenConfig(transformers.PretrainedConfig):
    """A user's config: the expert count field transformers families use, per model."""

    model_type = "uneven_moe_test"

    def __init__(self, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, **kw):
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kw)


class Experts(nn.Module):
    """transformers' experts interface: called with the chosen ids and their weights."""

    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.config = UnevenConfig(num_experts=experts, num_experts_per_tok=top_k)
        self.weight = nn.Parameter(torch.randn(experts, HIDDEN, HIDDEN) * 0.1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            w = self.weight[top_k_index[:, k]]
            out = out + top_k_weights[:, k, None] * torch.einsum("th,tho->to", hidden_states, w)
        return out


class Block(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = Experts(experts, top_k)

    def forward(self, x):
        weights, ids = torch.softmax(self.gate(x), -1).topk(self.top_k, -1)
        return x + self.experts(x, ids, weights)


class Layer(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.mlp = Block(experts, top_k)

    def forward(self, x):
        return self.mlp(x)


class UnevenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = UnevenConfig()
        self.layers = nn.ModuleList(Layer(e, k) for e, k in LAYERS)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _chosen(model, x):
    """The ids each layer's router picks, computed here from the same weights."""
    picks = []
    with torch.no_grad():
        for layer in model.layers:
            ids = torch.softmax(layer.mlp.gate(x), -1).topk(layer.mlp.top_k, -1).indices
            picks.append(
                np.bincount(ids.reshape(-1).numpy(), minlength=layer.mlp.gate.out_features)
            )
            x = layer(x)
    return picks


def test_layers_with_other_expert_counts_and_topk_run_through_table_store_and_report(tmp_path):
    torch.manual_seed(0)
    model = UnevenModel().train()
    metrics = PolicyMetrics(
        MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, log_expert_table=True)
    )
    metrics.attach(model, model.config)
    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
        tmp_path,
        run_name="uneven",
    )
    expected = []
    for step in range(3):
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(step))
        expected.append(_chosen(model, x))
        with metrics.step():
            model(x).sum().backward()
        out = metrics.finish_step(num_microbatches=1)
        sink.log(out, step)
        rows = out[mn.EXPERT_LOADS]
        for layer, (experts, top_k) in enumerate(LAYERS):
            got = [r[2] for r in rows if r[0] == layer]
            assert got == expected[-1][layer].tolist()  # one row per real expert
            assert sum(got) == TOKENS * top_k
            assert out[mn.layer_stat_key(layer, "dropped_fraction")] == 0.0
            counts = expected[-1][layer]
            assert out[mn.layer_stat_key(layer, "max_over_ideal")] == pytest.approx(
                counts.max() * experts / counts.sum()
            )
        assert out[mn.DROPPED_FRACTION] == 0.0
    sink.close()

    stored = list(read_expert_loads(store_path(tmp_path)))
    assert [step for step, _, _ in stored] == [0, 1, 2]
    for step, layer_ids, counts in stored:
        assert layer_ids.tolist() == [0, 1]
        for layer, (experts, _) in enumerate(LAYERS):
            np.testing.assert_array_equal(counts[layer][:experts], expected[step][layer])
            assert not counts[layer][experts:].any()  # no expert beyond the layer's own
    summary = render_report(tmp_path, dead_steps=1)
    assert "2 MoE layers × 4–8 experts" in summary
    _assert_summary_follows_each_layer(summary, expected)
    _assert_padding_is_grey_not_black(tmp_path)

    # The report's per-step max/ideal, block by block as it reads the store.
    blocks = list(read_expert_load_blocks(store_path(tmp_path), prepare=prepare_block, widths=True))
    moi = np.concatenate([b.moi for b in blocks])
    for step, picks in enumerate(expected):
        want = [c.max() * len(c) / c.sum() for c in picks]  # each layer over its own experts
        np.testing.assert_allclose(moi[step], want)


def _js_bits(before: np.ndarray, after: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits of two count vectors (the layer's real experts)."""

    def entropy(p):
        p = p[p > 0]
        return float(-(p * np.log2(p)).sum())

    p, q = before / before.sum(), after / after.sum()
    return entropy((p + q) / 2) - (entropy(p) + entropy(q)) / 2


def _dead_runs(series: list[np.ndarray]) -> int:
    """Maximal runs of consecutive steps with 0 tokens, over one layer's real experts."""
    zero = np.stack(series) == 0  # [steps, experts]
    starts = zero & np.vstack([np.ones((1, zero.shape[1]), bool), ~zero[:-1]])
    return int(starts.sum())


def _assert_summary_follows_each_layer(summary: str, expected: list[list[np.ndarray]]) -> None:
    """The summary's numbers for the uneven model, computed here from the routing alone."""
    last = expected[-1]
    per_layer = [c.max() * len(c) / c.sum() for c in last]
    [line] = [ln for ln in summary.splitlines() if ln.startswith("expert load over step")]
    head, worst = line.split("; worst: ")
    assert head.endswith(f"max/ideal mean {np.mean(per_layer):.2f} over 2 MoE layers × 4–8 experts")
    for layer, value in enumerate(per_layer):
        assert f"layer {layer} {value:.2f}" in worst
    dead = {la: np.nonzero(c == 0)[0].tolist() for la, c in enumerate(last) if (c == 0).any()}
    n_dead = sum(len(v) for v in dead.values())
    shown = "; ".join(f"layer {la}: {es}" for la, es in dead.items())
    assert f"dead experts (0 tokens, step 2): {f'{n_dead} — {shown}' if dead else 'none'}" in (
        summary
    )
    runs = sum(_dead_runs([step[la] for step in expected]) for la in range(len(LAYERS)))
    streaks = [ln for ln in summary.splitlines() if ln.startswith("dead-expert streaks")]
    assert streaks[0].endswith(": none") if runs == 0 else f": {runs} in " in streaks[0]
    drift = [
        _js_bits(expected[s - 1][la], expected[s][la])
        for s in range(1, len(expected))
        for la in range(len(LAYERS))
    ]
    assert f"bits): mean {np.mean(drift):.4f};" in summary


def _assert_padding_is_grey_not_black(run_dir) -> None:
    """Layer 0 has 4 experts: its cells 4-7 are no expert, drawn grey (not a dead expert's
    black) in the heatmap (top right) and in layer 0's over-steps panel."""
    for name in (HEATMAP_FILE, OVER_STEPS_FILE):
        image = imread(run_dir / name)[..., :3]
        grey = np.abs(image - 0xD4 / 255).max(axis=-1) < 0.02
        black = image.max(axis=-1) < 0.1
        assert grey.mean() > 0.05, f"{name}: the padding cells are grey"
        assert black.mean() < 0.02, f"{name}: no block of black (0-token) cells"
        rows, cols = np.nonzero(grey)
        if name == HEATMAP_FILE:
            assert rows.mean() < image.shape[0] / 2 < cols.mean(), "layer 0 (top), experts 4-7"


# ------------------------------------------------------------------ the store, without a model

UNEVEN = np.array([4, 8, 2])  # experts of three MoE layers


def _uneven_counts(rng, widths=UNEVEN, tokens=1000):
    counts = np.zeros((len(widths), int(max(widths))), dtype=np.int64)
    for row, w in enumerate(widths):
        counts[row, :w] = rng.multinomial(tokens, np.ones(w) / w)
    return counts


def _write_uneven(path, steps, seed=0):
    rng = np.random.default_rng(seed)
    written = {}
    with ExpertLoadStore(path) as store:
        for step in steps:
            written[step] = _uneven_counts(rng)
            store.append(step, [1, 3, 5], written[step], UNEVEN)
    return written


def _flags(path):
    with path.open("rb") as f:
        return [e.flags for e in scan_store(f).entries]


def test_store_round_trip_returns_each_layers_width(tmp_path):
    path = store_path(tmp_path)
    written = _write_uneven(path, range(3))
    with ExpertLoadStore(path) as store:  # the same shape with every layer 8 wide
        store.append(3, [1, 3, 5], np.full((3, 8), 7), [8, 8, 8])
    assert _flags(path) == [1, 1, 1, 0]  # widths only where the layers differ
    got = list(read_expert_loads(path))
    assert [s.step for s in got] == [0, 1, 2, 3]
    for stored in got[:3]:
        step, ids, counts = stored  # still unpacks as before
        assert ids.tolist() == [1, 3, 5] and stored.widths.tolist() == [4, 8, 2]
        np.testing.assert_array_equal(counts, written[step])
    assert got[3].widths.tolist() == [8, 8, 8]
    blocks = list(read_expert_load_blocks(path, workers=2))
    assert [b.steps.tolist() for b in blocks] == [[0, 1, 2], [3]], "a width change ends a block"
    assert [b.widths.tolist() for b in blocks] == [[4, 8, 2], [8, 8, 8]]
    seen = list(read_expert_load_blocks(path, prepare=lambda s, i, c, w: w.tolist(), widths=True))
    assert seen == [[4, 8, 2], [8, 8, 8]]


def test_uniform_and_first_format_stores_read_as_before(tmp_path):
    from tests.sinks.test_store import FIXTURE_V1, fixture_counts

    got = list(read_expert_loads(FIXTURE_V1))
    assert [s for s, _, _ in got] == [0, 1, 2, 3, 4]
    for step, _, counts in got:
        np.testing.assert_array_equal(counts, fixture_counts(step))
    assert all(s.widths.tolist() == [8, 8, 8] for s in got)
    # Widths equal to the columns change nothing: the record is byte for byte the old layout.
    counts = np.arange(24).reshape(3, 8)
    for name, widths in (("plain", None), ("widths", [8, 8, 8])):
        with ExpertLoadStore(tmp_path / name) as store:
            store.append(0, [1, 3, 5], counts, widths)
    assert (tmp_path / "plain").read_bytes() == (tmp_path / "widths").read_bytes()
    assert _flags(tmp_path / "plain") == [0]


def test_a_damaged_record_of_the_new_kind_costs_that_record_only(tmp_path):
    path = store_path(tmp_path)
    written = _write_uneven(path, range(6))
    with path.open("rb") as f:
        at = {e.step: e.offset for e in scan_store(f).entries}
    data = bytearray(path.read_bytes())
    data[at[1] + 36 + 2] ^= 0xFF  # step 1's payload
    data[at[4] + 4 : at[4] + 8] = b"\xff\xff\xff\xff"  # step 4's header
    path.write_bytes(bytes(data))
    skipped = []
    got = list(read_expert_loads(path, skipped=skipped))
    assert [s.step for s in got] == [0, 2, 3, 5]
    for stored in got:
        np.testing.assert_array_equal(stored.counts, written[stored.step])
        assert stored.widths.tolist() == [4, 8, 2]
    assert any("between steps 3 and 5: a damaged record, skipped" in s for s in skipped)
    assert any(
        "damaged record(s) (a payload failing its checksum, or not inflating to the size its "
        "header declares): step(s) 1" in s
        for s in skipped
    )


def test_a_record_from_a_newer_version_is_named_and_never_cut(tmp_path):
    import struct
    import zlib

    path = store_path(tmp_path)
    _write_uneven(path, range(3))
    with path.open("rb") as f:
        last = scan_store(f).entries[-1].offset
    data = bytearray(path.read_bytes())
    data[last + 22 : last + 24] = struct.pack("<H", 0x0003)  # a flag this version lacks
    data[last + 32 : last + 36] = struct.pack("<I", zlib.crc32(bytes(data[last : last + 32])))
    path.write_bytes(bytes(data))
    skipped = []
    assert [s.step for s in read_expert_loads(path, skipped=skipped)] == [0, 1]
    assert "step(s) 2 written by a newer version of nemo_moe_metrics" in skipped[0]
    size = path.stat().st_size
    ExpertLoadStore(path).close()  # a resumed writer keeps it
    assert path.stat().st_size == size


@pytest.mark.parametrize(
    ("widths", "match"),
    [
        ([4, 8], "one int per layer"),
        ([4, 8, 0], "widths must be in 1..8"),
        ([4, 8, 9], "widths must be in 1..8"),
        ([3, 8, 2], "layer row 0 has 3 experts but tokens in a column beyond them"),
    ],
)
def test_bad_widths_are_refused_with_the_problem_named(tmp_path, widths, match):
    counts = _uneven_counts(np.random.default_rng(0))
    with ExpertLoadStore(store_path(tmp_path)) as store, pytest.raises(StoreError, match=match):
        store.append(0, [1, 3, 5], counts, widths)


def test_table_rows_give_each_layers_width():
    rng = np.random.default_rng(2)
    counts = _uneven_counts(rng)
    rows = [
        [la, e, int(counts[r, e]), 0.0] for r, la in enumerate([1, 3, 5]) for e in range(UNEVEN[r])
    ]
    for order in (rows, rows[::-1]):
        ids, got, widths = table_to_counts_and_widths(order)
        assert sorted(ids.tolist()) == [1, 3, 5]
        by_id = {int(la): (got[r], int(widths[r])) for r, la in enumerate(ids)}
        for r, la in enumerate([1, 3, 5]):
            np.testing.assert_array_equal(by_id[la][0], counts[r])
            assert by_id[la][1] == UNEVEN[r]
    uniform = [[la, e, 1, 0.0] for la in range(3) for e in range(8)]
    assert table_to_counts_and_widths(uniform)[2].tolist() == [8, 8, 8]


def test_a_run_from_before_the_store_reads_the_widths_from_its_jsonl_rows(tmp_path):
    rng = np.random.default_rng(4)
    steps = {s: _uneven_counts(rng, tokens=40) for s in range(3)}
    steps[2][2, 1] = 0  # a real dead expert of the 2-expert layer
    runs = {}
    for name in ("store", "jsonl"):
        run = tmp_path / name
        run.mkdir()
        sink = build_sinks(
            LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
            run,
            run_name="uneven",
        )
        for step, c in steps.items():
            rows = [[la, e, int(c[la, e]), 0.0] for la in range(3) for e in range(UNEVEN[la])]
            sink.log({mn.EXPERT_LOADS: rows}, step)
        sink.close()
        runs[name] = run
    # The old layout: the table rows in metrics.jsonl, no store.
    store_path(runs["jsonl"]).unlink()
    with (runs["jsonl"] / "metrics.jsonl").open("w") as f:
        for step, c in steps.items():
            rows = [[la, e, int(c[la, e]), 0.0] for la in range(3) for e in range(UNEVEN[la])]
            f.write(json.dumps({"step": step, mn.EXPERT_LOADS: rows}) + "\n")
    texts = {
        k: render_report(r, out_dir=tmp_path / f"out_{k}").splitlines()[1:4]
        for k, r in runs.items()
    }
    assert texts["jsonl"] == texts["store"]
    assert "dead experts (0 tokens, step 2): 1 — layer 2: [1]" in texts["jsonl"]
    assert "over 3 MoE layers × 2–8 experts" in texts["jsonl"][0]


def test_dead_streaks_skip_padding_and_blocks_equal_single_steps():
    rng = np.random.default_rng(6)
    counts = np.stack([_uneven_counts(rng, tokens=6) for _ in range(12)])
    one = DeadStreaks(2)
    for s, c in enumerate(counts):
        one.update(s, [1, 3, 5], c, UNEVEN)
    blocked = DeadStreaks(2)
    for lo, hi in [(0, 1), (1, 7), (7, 12)]:
        blocked.update_block(range(lo, hi), [1, 3, 5], counts[lo:hi], UNEVEN)
    assert blocked.streaks() == one.streaks()
    assert one.streaks(), "6 tokens over 8 experts leave some real expert empty for 2 steps"
    assert all(s.expert < UNEVEN[[1, 3, 5].index(s.layer)] for s in one.streaks())


def test_alerts_judge_each_layer_by_its_own_experts():
    from nemo_moe_metrics.config import AlertsConfig
    from nemo_moe_metrics.sinks.alerts import AlertMonitor

    off = dict(drift=None, dropped_fraction=None, routing_disagreement=None)
    monitor = AlertMonitor(AlertsConfig(enabled=True, max_over_ideal=1.5, dead_steps=1, **off))
    layer0 = [30, 10, 10, 10]  # 4 experts: 30 tokens of 60 -> 30 * 4 / 60 = 2.0x ideal
    layer1 = [10] * 8
    fired = []
    for step in range(2):
        if step == 1:
            layer1 = [10] * 7 + [0]  # layer 1's expert 7 gets no token
        rows = [[0, e, c, 0.0] for e, c in enumerate(layer0)]
        rows += [[1, e, c, 0.0] for e, c in enumerate(layer1)]
        fired.append(monitor.check({mn.EXPERT_LOADS: rows}, step))
    [overloaded] = fired[0]
    assert (overloaded.kind, overloaded.layer, overloaded.expert) == ("max_over_ideal", 0, 0)
    assert "load 2.00x ideal" in overloaded.message
    [dead] = fired[1]  # never layer 0's columns 4-7, which are no expert
    assert (dead.kind, dead.layer, dead.expert) == ("dead_steps", 1, 7)


def test_a_layer_that_changes_its_expert_count_mid_run_is_named(tmp_path):
    from nemo_moe_metrics.report import ReportError

    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False, table_every=1),
        tmp_path,
        run_name="changed",
    )
    for step, first in enumerate([4, 4, 8]):  # layer 0 grows to 8 experts at step 2
        rows = [[0, e, 5, 0.0] for e in range(first)] + [[1, e, 5, 0.0] for e in range(8)]
        sink.log({mn.EXPERT_LOADS: rows}, step)
    sink.close()
    with pytest.raises(
        ReportError,
        match=r"step 2 has MoE layers \[0, 1\] x 8 experts but step "
        r"0 had \[0, 1\] x \[4, 8\]; the model changed within the run",
    ):
        render_report(tmp_path)
    assert "× 4–8 experts" in render_report(tmp_path, steps=(0, 1))
