"""examples/integrate_hf_fsdp.py on 2 gloo ranks (FSDP2 and DDP), checked against oracles.

Oracles, independent of the code under test: transformers' own ``load_balancing_loss_func`` on
router logits captured by this test's own hooks, the routed token count from the attention masks,
and ``get_flops_estimator(config)(seq_lens).total`` on the step's real sequence lengths.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from dist import ok_values, run_ranks

from nemo_moe_metrics.export import metric_names as mn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrate_hf_fsdp.py"
STEPS, MICRO, K = 2, 2, 2


def _example():
    spec = importlib.util.spec_from_file_location("integrate_hf_fsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank, world_size, out_dir, wrap):
    import torch
    import torch.distributed as dist
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    dist.init_process_group("gloo")
    example = _example()
    seen: list[tuple[int, float, int]] = []  # (layer, transformers' loss, routed tokens)
    build = example.build_model

    def build_with_oracle(config, wrap, device):
        model = build(config, wrap, device)
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                layer = int(name.split("layers.")[1].split(".")[0])

                def hook(mod, args, output, layer=layer):
                    if mod.training and torch.is_grad_enabled():
                        logits = output[0].detach()
                        loss = load_balancing_loss_func((logits,), num_experts=8, top_k=K)
                        seen.append((layer, float(loss), logits.shape[0]))

                module.register_forward_hook(hook)
        return model

    example.build_model = build_with_oracle
    history = example.run(Path(out_dir), wrap=wrap, steps=STEPS, num_microbatches=MICRO)
    lens = [
        [int(n) for _, mask in example.microbatches(rank, s, MICRO, "cpu") for n in mask.sum(-1)]
        for s in range(STEPS)
    ]
    return history, seen, lens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_hf_example_matches_transformers_and_flop_registry(tmp_path, wrap):
    from nemo_moe_metrics.flops import get_flops_estimator

    results = ok_values(run_ranks(_rank, 2, str(tmp_path), wrap, timeout=280))
    config = _example().tiny_config()
    estimate = get_flops_estimator(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    per_forward = 2  # layers
    for step in range(STEPS):
        out = results[0][0][step]
        assert results[1][0][step] == out  # the same dict on every rank
        # every rank's oracle records of this step: microbatches x layers
        recs = [
            r[1][step * MICRO * per_forward : (step + 1) * MICRO * per_forward] for r in results
        ]
        seq_lens = np.array([n for r in results for n in r[2][step]])
        for layer in (0, 1):
            mine = [(v, t) for rank_recs in recs for (lay, v, t) in rank_recs if lay == layer]
            assert len(mine) == 2 * MICRO
            positions = sum(t for _, t in mine)  # every row the router saw, padding included
            table = np.array(out[mn.EXPERT_LOADS], dtype=float)
            # The routed counts are the real tokens' (the padding is left out) ...
            assert table[table[:, 0] == layer, 2].sum() == seq_lens.sum() * K
            # ... and the experts' work on the padding is the padding fraction.
            assert out[mn.layer_stat_key(layer, "padding_fraction")] == pytest.approx(
                1 - seq_lens.sum() / positions
            )
            expected = float(np.mean([v for v, _ in mine]))  # mean over microbatches and ranks
            key = mn.aux_loss_layer_key("load_balancing_loss", layer)
            assert out[key] == pytest.approx(expected, rel=1e-5)
        assert out[mn.TOKENS] == seq_lens.sum()
        assert out[mn.ESTIMATED_FLOPS] == pytest.approx(estimate(seq_lens).total, rel=1e-12)
        assert rows[step][mn.ESTIMATED_FLOPS] == pytest.approx(out[mn.ESTIMATED_FLOPS])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
