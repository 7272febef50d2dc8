"""torchtitan 0.3.0 MoE models (DeepSeek-V3 and Qwen3 MoE families, tiny, CPU) through
``PolicyMetrics.attach(model, config)``: the same collector, reducer and FLOP registry.

Independent sources: a probe hook on each ``TokenChoiceTopKRouter`` counting its expert ids with
``torch.bincount``; torchtitan's own ``MoE.tokens_per_expert_E`` buffer; the ``expert_bias_E``
buffers moved by torchtitan's own optimizer pre-hook (``register_moe_load_balancing_hook``);
``FlopCounterMode`` on the real model code. One spawned rank (gloo, so torchtitan's
``ParallelDims`` can build its mesh) runs every scenario.
"""

import numpy as np
import pytest
from dist import ok_values, run_ranks

pytestmark = pytest.mark.torchtitan

pytest.importorskip(
    "torchtitan", reason="needs torchtitan 0.3.0 (docs/en/torchtitan.md: the install line)"
)

FAMILIES = ("deepseek_v3", "qwen3_moe")
BATCH, SEQ, STEPS = 2, 32, 2


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs):
    # aten._grouped_mm counts 0 in FlopCounterMode: 2 * rows * inner * out for every group
    # together (2-D A against 3-D B, and the 2-D x 2-D weight gradient).
    return 2 * int(np.prod(a_shape)) * int(b_shape[-1])


def _train(family, *, ac=False, compiled=False, steps=STEPS):
    import torch
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed import ParallelDims

    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.integrations.torchtitan import (
        build_model,
        tiny_config,
        use_sdpa_attention,
    )
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    config = use_sdpa_attention(tiny_config(family))
    model = build_model(config, seed=0)
    if ac:
        from torchtitan.distributed.activation_checkpoint import FullAC

        FullAC(FullAC.Config()).apply(model)
    if compiled:
        torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile
        for block in model.layers.values():
            block.compile(backend="aot_eager", fullgraph=True)
    probe: dict[int, list] = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "TokenChoiceTopKRouter" and not compiled:  # .tolist(): eager
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(mod, args, out, layer=layer):
                counts = torch.bincount(out[1].reshape(-1), minlength=mod.num_experts)
                probe.setdefault(layer, []).append(counts.tolist())

            m.register_forward_hook(hook)
    moes = {
        int(n.split("layers.")[1].split(".")[0]): m
        for n, m in model.named_modules()
        if type(m).__name__ == "MoE"
    }
    metrics = PolicyMetrics(
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            log_expert_table=True,
            track_throughput=True,
            track_flops=True,
        )
    )
    metrics.attach(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    register_moe_load_balancing_hook(optimizer, [model], dims)  # torchtitan's bias update
    out = {"steps": [], "bias0": {k: m.expert_bias_E.tolist() for k, m in moes.items()}}
    for step in range(steps):
        probe.clear()
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
        with metrics.step():
            metrics.microbatch(seq_lens=torch.full((BATCH,), SEQ))
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten()
            )
            loss.backward()
            buffers = {k: m.tokens_per_expert_E.tolist() for k, m in moes.items()}
            optimizer.step()  # the pre-hook moves expert_bias_E and zeroes the buffer
            optimizer.zero_grad()
        result = metrics.finish_step(num_microbatches=1)
        table = {}
        for layer, expert, tokens_, _ in result.pop(mn.EXPERT_LOADS):
            table.setdefault(int(layer), {})[int(expert)] = int(tokens_)
        out["steps"].append(
            {
                "probe": {k: np.sum(v, axis=0).tolist() for k, v in probe.items()},
                "probe_calls": {k: len(v) for k, v in probe.items()},
                "buffer": buffers,
                "table": {k: [v[e] for e in sorted(v)] for k, v in table.items()},
                "bias": {k: m.expert_bias_E.tolist() for k, m in moes.items()},
                "metrics": result,
            }
        )
    return out


def _flops(family):
    import torch
    from torch.nn.attention import SDPBackend
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.integrations.torchtitan import (
        build_model,
        tiny_config,
        use_sdpa_attention,
    )

    config = use_sdpa_attention(tiny_config(family))
    model = build_model(config, seed=1)
    for m in model.modules():
        if type(m).__name__ == "ScaledDotProductAttention":
            m.sdpa_backends = [SDPBackend.MATH]  # the CPU flash kernel counts 0
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flop}
    )
    with counter:
        model(tokens).float().sum().backward()
    # The counter multiplies the full T x T attention (no causal halving): causal=False.
    ours = get_flops_estimator(config)([SEQ] * BATCH, causal=False).total
    return counter.get_total_flops(), ours


def _all(rank, world_size):
    import torch.distributed as dist

    from nemo_moe_metrics.integrations.torchtitan import use_cpu_device_mesh

    dist.init_process_group("gloo")  # torchtitan's ParallelDims builds a device mesh
    use_cpu_device_mesh()
    out = {}
    for family in FAMILIES:
        out[family] = {"plain": _train(family), "ac": _train(family, ac=True, steps=1)}
        out[family]["flops"] = _flops(family)
    try:
        out["compiled"] = _train("deepseek_v3", compiled=True, steps=1)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        out["compiled"] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def titan():
    (result,) = ok_values(run_ranks(_all, 1, timeout=600, threads=2))
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_counts_equal_router_outputs_and_torchtitans_buffer(titan, family):
    for step in titan[family]["plain"]["steps"]:
        assert sorted(step["table"]) == sorted(step["probe"])
        for layer, probe in step["probe"].items():
            assert step["table"][layer] == probe
            assert step["buffer"][layer] == [float(c) for c in probe]
            assert sum(probe) == BATCH * SEQ * 2  # top-2
    layers = sorted(titan[family]["plain"]["steps"][0]["table"])
    assert layers == ([1, 2] if family == "deepseek_v3" else [0, 1, 2])  # dense first layer


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_activation_checkpointing_doubles_its_buffer_not_our_counts(titan, family):
    plain, ac = titan[family]["plain"]["steps"][0], titan[family]["ac"]["steps"][0]
    for layer, counts in plain["probe"].items():
        assert ac["probe_calls"][layer] == 2  # the router ran again in backward
        assert ac["table"][layer] == counts  # ours: the forward's routing, once
        assert ac["buffer"][layer] == [2.0 * c for c in counts]  # torchtitan's TODO


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_expert_bias_metrics_equal_the_buffers(titan, family):
    run = titan[family]["plain"]
    before = run["bias0"]
    for step in run["steps"]:
        m, after = step["metrics"], step["bias"]
        ranges, updates = [], []
        for layer in after:
            b, b0 = np.asarray(after[layer]), np.asarray(before[layer])
            ranges.append(float(np.ptp(b)))
            updates.append(float(np.abs(b - b0).mean()))
            assert m[f"moe/layer_{layer}/expert_bias_range"] == pytest.approx(ranges[-1], abs=1e-9)
            assert m[f"moe/layer_{layer}/expert_bias_update"] == pytest.approx(
                updates[-1], abs=1e-9
            )
        assert m["moe/expert_bias_range"] == pytest.approx(np.mean(ranges), abs=1e-9)
        assert m["moe/expert_bias_update"] == pytest.approx(np.mean(updates), abs=1e-9)
        assert m["moe/expert_bias_update"] > 0  # torchtitan's pre-hook really moved it
        before = after


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_flops_from_the_config_equal_flop_counter_on_its_code(titan, family):
    counted, ours = titan[family]["flops"]
    assert counted > 0
    assert ours == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_train_perf_flops_use_the_torchtitan_estimator(titan, family):
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.integrations.torchtitan import tiny_config

    m = titan[family]["plain"]["steps"][0]["metrics"]
    expected = get_flops_estimator(tiny_config(family))([SEQ] * BATCH).total
    assert m["train_perf/estimated_flops"] == pytest.approx(expected)
    assert m["train_perf/tokens"] == BATCH * SEQ


def test_torchtitan_compiled_blocks_count_exactly_or_say_why(titan):
    compiled = titan["compiled"]
    if isinstance(compiled, str):
        pytest.fail(f"torch.compile of the blocks failed: {compiled}")
    step = compiled["steps"][0]
    plain = titan["deepseek_v3"]["plain"]["steps"][0]
    assert step["table"] == plain["table"]  # aot_eager runs the same ops: the same routing
    for layer, counts in step["table"].items():
        assert step["buffer"][layer] == [float(c) for c in counts]  # torchtitan's own count
