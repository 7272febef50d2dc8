"""End to end on a real megatron-core MoE model: routing counts -> sinks -> report.

A test-local hook counts each router's routing map (the independent reference); the counts
travel through the real sinks (JSONL, TensorBoard) and the report must give back the numbers
computed here from the routing maps. The first layer is dense, so MoE layers are 1, 2, 3.
"""

import re
from pathlib import Path

import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.megatron

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
STEPS = 3


def _train_and_log(rank, world_size, run_dir):
    import torch

    from nemo_moe_metrics.config import LoggerConfig, load_recipe
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        causal_attention_mask,
        init_distributed,
    )
    from nemo_moe_metrics.sinks import build_sinks

    recipe = load_recipe(RECIPE, ["policy.megatron_cfg.expert_model_parallel_size=1"])
    model_cfg = recipe.policy.model
    init_distributed(recipe.policy.megatron_cfg)
    from megatron.core.transformer.moe.router import TopKRouter

    model = build_gpt_model(model_cfg, recipe.policy.megatron_cfg)
    counts: dict[int, torch.Tensor] = {}

    def count(router, _inputs, output):
        # Global 0-based layer id; the routing map is [tokens, experts] booleans.
        layer = router.layer_number - 1
        counts[layer] = counts.get(layer, 0) + output[1].sum(dim=0)

    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(count)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = LoggerConfig(wandb_enabled=False, table_every=1)
    sink = build_sinks(
        cfg, Path(run_dir), run_name="megatron-tiny", rank=rank, config=recipe.model_dump()
    )
    s = model_cfg.seq_length
    logged = []
    torch.manual_seed(7)
    for step in range(STEPS):
        counts.clear()
        tokens = torch.randint(0, model_cfg.vocab_size, (4, s))
        loss = model(tokens, torch.arange(s).expand(4, s), causal_attention_mask(s), labels=tokens)
        loss.mean().backward()
        opt.step()
        opt.zero_grad()
        table = {layer: c.tolist() for layer, c in sorted(counts.items())}
        rows = [
            [layer, e, int(n), 100.0 * n / sum(c)]
            for layer, c in table.items()
            for e, n in enumerate(c)
        ]
        sink.log({mn.EXPERT_LOADS: rows, mn.TOKENS: tokens.numel()}, step)
        logged.append(table)
    sink.close()
    return logged


@pytest.mark.timeout(180)
def test_report_of_a_real_megatron_run_matches_its_routing_maps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_moe_metrics.report import render_report
    from nemo_moe_metrics.sinks import TENSORBOARD_DIR

    (logged,) = ok_values(run_ranks(_train_and_log, 1, str(tmp_path), timeout=150))
    last = logged[-1]
    assert sorted(last) == [1, 2, 3], "dense layer 0 has no router"
    for c in last.values():
        assert sum(c) == 4 * 32 * 2  # tokens x top-k, nothing dropped

    def moi(c):
        return max(c) * len(c) / sum(c)

    summary = render_report(tmp_path)
    assert f"expert load over step {STEPS - 1}:" in summary
    worst = re.search(r"over 3 MoE layers; worst: (.*)", summary).group(1)
    reported = {int(m[1]): float(m[2]) for m in re.finditer(r"layer (\d+) ([\d.]+)", worst)}
    assert reported == {la: round(moi(c), 2) for la, c in last.items()}
    values = list(reported.values())
    assert values == sorted(values, reverse=True)
    window = render_report(tmp_path, steps=(0, STEPS - 1))
    summed = {la: [sum(t[la][e] for t in logged) for e in range(8)] for la in last}
    top = max(summed, key=lambda la: moi(summed[la]))
    assert f"worst: layer {top} {moi(summed[top]):.2f}" in window

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train_perf/tokens"]
    assert [e.value for e in acc.Scalars("train_perf/tokens")] == [128.0] * STEPS
