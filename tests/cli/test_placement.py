"""`nemo-moe-metrics placement` and `ingest sglang` on real stores: the plan file, balancedness
computed independently, the engine files, the errors, rollout loads and SGLang dumps."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_moe_metrics.cli import main
from nemo_moe_metrics.placement.eplb import rebalance_experts
from nemo_moe_metrics.sinks.rollout_store import (
    RolloutLoadRecorder,
    record_rollout_loads,
)
from nemo_moe_metrics.sinks.store import ExpertLoadStore, read_expert_loads, store_path

LAYERS = [1, 3, 5]

EXPERTS = 16


def _skewed(rng, steps):
    base = rng.pareto(0.9, size=(len(LAYERS), EXPERTS)) + 0.05
    return {s: rng.poisson(base * 50).astype(np.int64) for s in steps}


def _store(run_dir: Path, counts: dict[int, np.ndarray]) -> None:
    with ExpertLoadStore(store_path(run_dir)) as store:
        for step, c in counts.items():
            store.append(step, LAYERS, c)


def _balancedness_by_hand(weight_row, gpu_of_slot, experts_of_slot):
    """Loads per GPU, a replicated expert split evenly: written out with plain loops."""
    replicas = {}
    for e in experts_of_slot:
        replicas[e] = replicas.get(e, 0) + 1
    loads = {}
    for g, e in zip(gpu_of_slot, experts_of_slot, strict=True):
        loads[g] = loads.get(g, 0.0) + weight_row[e] / replicas[e]
    vals = list(loads.values())
    return (sum(vals) / len(vals)) / max(vals)


def test_plan_file_holds_a_valid_plan_and_balancedness_computed_by_hand(tmp_path, capsys):
    rng = np.random.default_rng(3)
    counts = _skewed(rng, range(10))
    _store(tmp_path, counts)
    out = tmp_path / "plans" / "PLAN.json"
    args = ["placement", str(tmp_path), "--ep-size", "4", "--redundant-experts", "4"]
    engines = ["--sglang-out", str(out.with_suffix(".sglang.json"))]
    engines += ["--vllm-out", str(out.with_suffix(".vllm.json"))]
    assert main([*args, "--steps", "2-7", "--out", str(out), *engines]) == 0
    plan = json.loads(out.read_text())
    weight = sum(counts[s] for s in range(2, 8))
    assert plan["layers"] == LAYERS and plan["source"]["steps"] == [2, 7]
    for i, row in enumerate(plan["physical_to_logical"]):
        assert len(row) == EXPERTS + 4 and set(row) == set(range(EXPERTS))
        gpus = [p // 5 for p in range(20)]
        assert plan["balancedness_after"][i] == pytest.approx(
            _balancedness_by_hand(weight[i], gpus, row), abs=1e-6
        )
        contiguous = list(range(EXPERTS))
        assert plan["balancedness_before"][i] == pytest.approx(
            _balancedness_by_hand(weight[i], [e // 4 for e in contiguous], contiguous), abs=1e-6
        )
    # At least as balanced as DeepSeek's algorithm on the same loads.
    eplb = rebalance_experts(weight, EXPERTS + 4, 1, 1, 4).physical_to_logical
    for i in range(len(LAYERS)):
        ref = _balancedness_by_hand(weight[i], [p // 5 for p in range(20)], eplb[i].tolist())
        assert plan["balancedness_after"][i] >= ref - 1e-6  # JSON keeps 6 decimals
    sglang = json.loads((tmp_path / "plans" / "PLAN.sglang.json").read_text())
    assert list(sglang) == ["physical_to_logical_map"]
    rows = sglang["physical_to_logical_map"]
    assert len(rows) == 6  # decoder layers 0..5; 0, 2, 4 have no experts: trivial rows
    assert rows[0] == [p % EXPERTS for p in range(20)]
    assert rows[3] == plan["physical_to_logical"][1]
    vllm = json.loads((tmp_path / "plans" / "PLAN.vllm.json").read_text())
    assert vllm == {"num_redundant_experts": 4}
    text = capsys.readouterr().out
    assert "balancedness" in text and "hierarchical" not in text and "global policy" in text


def test_sweep_is_monotone_and_draws_the_picture(tmp_path, capsys):
    _store(tmp_path, _skewed(np.random.default_rng(5), range(4)))
    out = tmp_path / "PLAN.json"
    assert main(["placement", str(tmp_path), "--ep-size", "4", "--sweep", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["redundant_experts"] for r in sweep] == [0, 4, 8, 12, 16]
    table = np.array([r["balancedness"] for r in sweep])
    assert (np.diff(table, axis=0) >= 0).all()
    assert (tmp_path / "placement_sweep.png").stat().st_size > 0


@pytest.mark.parametrize(
    "flags,option",
    [
        (["--ep-size", "4", "--redundant-experts", "3"], "--redundant-experts"),
        (["--ep-size", "3"], "--ep-size"),
        (["--ep-size", "4", "--groups", "3"], "--groups"),
        (["--ep-size", "4", "--nodes", "3"], "--nodes"),
        (["--ep-size", "4", "--phase", "rollout"], "ingest sglang"),
        (["--ep-size", "4", "--steps", "50-60"], "--steps"),
    ],
)
def test_impossible_plans_name_the_option_to_change(tmp_path, capsys, flags, option):
    _store(tmp_path, _skewed(np.random.default_rng(1), range(3)))
    assert main(["placement", str(tmp_path), *flags]) == 2
    assert option in capsys.readouterr().err


def test_rollout_loads_are_a_second_phase_and_old_stores_read_unchanged(tmp_path, capsys):
    train = _skewed(np.random.default_rng(2), range(3))
    _store(tmp_path, train)
    assert not store_path(tmp_path, "rollout").exists()  # an old run: no rollout phase
    with RolloutLoadRecorder(tmp_path) as rec:
        rec.record_routes(0, LAYERS, np.full((5, 3, 2), 7), EXPERTS)
    rollout = np.zeros((3, EXPERTS), np.int64)
    rollout[:, 3] = 40
    rollout[:, 9] = 10
    record_rollout_loads(tmp_path, 1, LAYERS, rollout)
    got = list(read_expert_loads(store_path(tmp_path, "rollout")))
    assert [s for s, _, _ in got] == [0, 1]
    assert got[0][2][:, 7].tolist() == [10, 10, 10] and got[1][2].tolist() == rollout.tolist()
    # Training's store is untouched.
    assert [c.tolist() for _, _, c in read_expert_loads(store_path(tmp_path))] == [
        train[s].tolist() for s in range(3)
    ]
    out = tmp_path / "R.json"
    assert main(["placement", str(tmp_path), "--ep-size", "4", "--phase", "rollout",
                 "--steps", "1-1", "--out", str(out)]) == 0  # fmt: skip
    plan = json.loads(out.read_text())
    # Contiguous: GPU 0 holds experts 0-3 (40 tokens), GPU 2 holds 8-11 (10): 12.5 / 40.
    assert plan["balancedness_before"] == [pytest.approx(12.5 / 40)] * 3


def _sglang_dump(path, count):
    torch.save({"rank": 0, "logical_count": count, "average_utilization_rate_over_window": None},
               path)  # fmt: skip


def test_sglang_stat_dump_is_ingested_summed_over_passes_dense_layers_left_out(tmp_path, capsys):
    rng = np.random.default_rng(4)
    count = torch.from_numpy(rng.integers(0, 50, size=(5, 4, EXPERTS))).to(torch.int32)
    count[:, 0] = 0  # layer 0 is dense in the model: SGLang keeps a row of zeros
    dump = tmp_path / "expert_distribution_recorder_1700000000.0.pt"
    _sglang_dump(dump, count)
    run = tmp_path / "run"
    run.mkdir()
    assert main(["ingest", "sglang", str(dump), "--run", str(run), "--step", "12"]) == 0
    assert "layers without tokens left out: [0]" in capsys.readouterr().out
    [(step, ids, counts)] = list(read_expert_loads(store_path(run, "rollout")))
    assert step == 12 and ids.tolist() == [1, 2, 3]
    assert counts.tolist() == count.sum(0)[1:].tolist()


@pytest.mark.parametrize(
    "text,window",
    [("2-7", (2, 7)), ("2:7", (2, 7)), ("5-", (5, None)), ("-5", (None, 5)), ("4", (4, 4))],
)
def test_steps_windows(text, window):
    from nemo_moe_metrics.cli.placement import parse_window

    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["7-2", "a-b", "-", ""])
def test_bad_steps_windows_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        main(["placement", ".", "--ep-size", "2", "--steps", text])
    assert "--steps" in capsys.readouterr().err
