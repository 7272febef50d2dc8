"""examples/integrate_torchtitan.py on 2 gloo ranks: torchtitan's own FSDP2 parallelize, checked
against oracles. Oracles: a probe on each router counting its expert ids (``torch.bincount``),
summed over both ranks by the test; the ``expert_bias_E`` buffers read on each rank after the
run; the sequence lengths of the batch."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks
from html_page_check import check_page

pytestmark = pytest.mark.torchtitan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrate_torchtitan.py"
STEPS = 2


def _example():
    spec = importlib.util.spec_from_file_location("integrate_torchtitan", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank, world_size, out_dir):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    example = _example()
    probe: list[dict[int, list[int]]] = []
    moes = {}
    parallelize = example.parallelize

    def parallelize_with_oracle(model, family, world):
        for name, m in model.named_modules():
            layer = name.split("layers.")[1].split(".")[0] if "layers." in name else None
            if type(m).__name__ == "TokenChoiceTopKRouter":

                def hook(mod, args, out, layer=int(layer)):
                    if not probe or layer in probe[-1]:
                        probe.append({})
                    counts = torch.bincount(out[1].reshape(-1), minlength=mod.num_experts)
                    probe[-1][layer] = counts.tolist()

                m.register_forward_hook(hook)
            if type(m).__name__ == "MoE":
                moes[int(layer)] = m
        return parallelize(model, family, world)

    example.parallelize = parallelize_with_oracle
    history = example.run(Path(out_dir), steps=STEPS)
    bias = {k: m.expert_bias_E.tolist() for k, m in moes.items()}
    return history, probe, bias


@pytest.mark.timeout(400)
def test_torchtitan_example_matches_router_outputs_and_bias_buffers(tmp_path, page_browser):
    pytest.importorskip(
        "torchtitan", reason="needs torchtitan 0.3.0 (docs/en/torchtitan.md: the install line)"
    )
    from nemo_moe_metrics.export import metric_names as mn

    results = ok_values(run_ranks(_rank, 2, str(tmp_path), timeout=380))
    (h0, p0, b0), (h1, p1, b1) = results
    assert h0 == h1  # the same dict on every rank
    assert b0 == b1  # torchtitan's pre-hook keeps the replicas' bias equal
    for step in range(STEPS):
        out = h0[step]
        table = np.array(out[mn.EXPERT_LOADS], dtype=np.int64)
        for layer in (1, 2):  # layer 0 is dense
            expected = np.add(p0[step][layer], p1[step][layer])
            assert table[table[:, 0] == layer, 2].tolist() == expected.tolist()
        assert out[mn.TOKENS] == 2 * 2 * 32
    last = h0[-1]
    for layer, b in b0.items():
        assert last[f"moe/layer_{layer}/expert_bias_range"] == pytest.approx(np.ptp(b), abs=1e-9)
    assert last["moe/expert_bias_range"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    # report --html of the example's run (tests/support/html_page_check.py).
    check_page(tmp_path, page_browser, out_dir=tmp_path / "page")


def test_torchtitan_example_names_the_extra_when_torchtitan_is_missing(monkeypatch, tmp_path):
    from nemo_moe_metrics.runtime.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan now fails
    with pytest.raises(MissingExtraError, match=r"install it with: pip install --no-deps torch"):
        _example().run(tmp_path)


def _rank_refused(rank, world_size, out_dir):
    import torch.distributed as dist

    from nemo_moe_metrics.run_dir import RunDirBusyError

    dist.init_process_group("gloo")
    try:
        _example().run(Path(out_dir), steps=1)
    except RunDirBusyError as err:
        return str(err)
    return None


@pytest.mark.timeout(200)
def test_torchtitan_example_refuses_a_second_writer_naming_it(tmp_path):
    # The run directory is held (this process: the first writer) and has logged a step: the
    # example's rank 0 is refused naming the holder, and no file of the run changes.
    pytest.importorskip(
        "torchtitan", reason="needs torchtitan 0.3.0 (docs/en/torchtitan.md: the install line)"
    )
    import hashlib
    import os

    from nemo_moe_metrics.run_dir import RunDirLock

    def digests():  # not the lock file: closing any descriptor of it drops this process's lock
        files = [p for p in tmp_path.iterdir() if p.name != ".run.lock"]
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    with RunDirLock(tmp_path).acquire(writer=True):
        (tmp_path / "metrics.jsonl").write_text('{"step": 0, "moe/max_over_ideal": 1.5}\n')
        before, holder = digests(), RunDirLock.probe(tmp_path)
        (refused,) = ok_values(run_ranks(_rank_refused, 1, str(tmp_path), timeout=180))
        assert digests() == before and RunDirLock.probe(tmp_path) == holder
    assert refused is not None and f"pid {os.getpid()} on host" in refused
