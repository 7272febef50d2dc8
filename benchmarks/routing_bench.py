"""The cost of one metric family: step time with its flag on / off.

Two families: routing consistency (``track_routing_consistency``, :func:`routing_bench`) and
router decision health (``track_router_health``, :func:`router_health_bench`). One gloo rank,
one thread, the step benchmark's megatron-core MoE GPTModel trained by megatron's own schedule.
Both variants keep every other MoE metric on (expert loads, aux losses, per-layer keys); the
"on" steps add the family (routing: rollout routes passed to ``microbatch()``, compared in the
router hooks, one more ``all_reduce`` at the export; health: the router's logits captured from
its ``gating`` and judged in the router hooks, two more ``all_reduce`` at the export), the "off"
steps run the same ``PolicyMetrics`` with the family's tracker detached (and, for health, the
logits capture undone), which is what the flag off builds. Steps are interleaved in pairs on
the same batches and routes; the ratio is the median of per-pair ratios.

Also counted: host reads the family adds per microbatch (must be 0) and per export, and the
device memory of one microbatch's routes at a 94-layer x top-8 x 32k-token shape (computed:
``moe.routing.route_memory_bytes``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from nemo_moe_metrics.testing import ok_values, run_ranks

#: The shape the memory figure is computed for (a DeepSeek-V3-size MoE stack, 32k tokens).
MEMORY_SHAPE = dict(tokens=32 * 1024, moe_layers=94, topk=8)


def _rank(
    rank: int, world_size: int, step_cfg: Any, pairs: int, warmup: int, family: str = "routing"
) -> dict[str, Any]:
    torch.set_num_threads(1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from benchmarks.host_reads import HostReadCounter
    from nemo_moe_metrics import PolicyMetrics
    from nemo_moe_metrics.config import MegatronConfig, MetricsConfig, ModelConfig
    from nemo_moe_metrics.families.router_health import RouterHealth
    from nemo_moe_metrics.families.routing_consistency import RoutingConsistency
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
    from nemo_moe_metrics.megatron.model import (
        build_gpt_model,
        causal_attention_mask,
        init_distributed,
    )

    s = step_cfg
    init_distributed(MegatronConfig(), seed=1234)
    model_cfg = ModelConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        ffn_hidden_size=4 * s.hidden_size,
        num_attention_heads=s.num_attention_heads,
        vocab_size=s.vocab_size,
        seq_length=s.seq_length,
        num_experts=s.num_experts,
        moe_router_topk=s.topk,
        moe_ffn_hidden_size=s.moe_ffn_hidden_size,
    )
    torch.manual_seed(1234)
    model = build_gpt_model(model_cfg, MegatronConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    routing_family = family == "routing"
    metrics = PolicyMetrics(
        MetricsConfig(
            track_moe_metrics=True,
            moe_per_layer_logging=True,
            track_routing_consistency=routing_family,
            track_router_health=not routing_family,
        )
    )
    metrics.attach(model, model.config)
    collector = metrics._collector
    family = metrics.family(RoutingConsistency if routing_family else RouterHealth)
    routers = compat.megatron_routers(model)
    mask = causal_attention_mask(s.seq_length)
    pos = torch.arange(s.seq_length).expand(s.micro_batch_size, s.seq_length)
    gen = torch.Generator().manual_seed(rank)
    layers = s.num_layers

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(s.num_microbatches):
            tokens = torch.randint(
                0, s.vocab_size, (s.micro_batch_size, s.seq_length), generator=gen
            )
            scores = torch.rand(
                s.micro_batch_size, s.seq_length, layers, s.num_experts, generator=gen
            )
            out.append((tokens, scores.argsort(dim=-1)[..., : s.topk]))
        return out

    subscribed = [True]  # attach subscribed the family's observer to the collector

    def routing(on: bool) -> None:
        # What the flag off builds: no family, no subscription to the collector (and for
        # router health no logit capture).
        if on and family not in metrics._families:
            metrics._families.append(family)
        if not on and family in metrics._families:
            metrics._families.remove(family)
        if on != subscribed[0]:
            (collector.subscribe if on else collector.unsubscribe)(family.observer)
            subscribed[0] = on
        if not routing_family:
            for router in routers:
                (compat.capture_router_logits if on else compat.release_router_logits)(router)

    cpu: dict[bool, list[float]] = {True: [], False: []}

    def step(on: bool, data: list, counter: Any = None) -> float:
        routing(on)

        def forward_step(data_iterator, model):
            if counter is not None:
                counter.mark()
            tokens, routes = next(data_iterator)
            lengths = torch.full((s.micro_batch_size,), s.seq_length)
            if on and routing_family:
                metrics.microbatch(seq_lens=lengths, rollout_routes=routes)
            else:
                metrics.microbatch(seq_lens=lengths)
            output = model(tokens, pos, mask, labels=tokens)
            return output, lambda out: (out.float().mean(), {})

        t0, c0 = time.perf_counter(), time.process_time()
        with metrics.step():
            with cpu_device_mode():
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(data),
                    model=[model],
                    num_microbatches=s.num_microbatches,
                    seq_length=s.seq_length,
                    micro_batch_size=s.micro_batch_size,
                    forward_only=False,
                )
            if counter is not None:
                counter.mark()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if counter is not None:
            counter.mark()
        out = metrics.finish_step(num_microbatches=s.num_microbatches)
        elapsed = time.perf_counter() - t0
        cpu[on].append(time.process_time() - c0)
        keys.update(k for k in out if ("routing" if routing_family else "router_") in k)
        return elapsed

    keys: set[str] = set()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(warmup + pairs):
        data = batches()
        for on in (False, True) if i % 2 == 0 else (True, False):
            seconds = step(on, data)
            if i >= warmup:
                times[on].append(seconds)
    cpu_ratios = [a / b for a, b in zip(cpu[True][-pairs:], cpu[False][-pairs:], strict=True)]
    # The routing code itself, timed from inside: what the flag adds to a step, without noise.
    direct: list[float] = []
    tracker, reducer = family.tracker, family.reducer
    owner = (tracker, tracker, reducer) if routing_family else (tracker, compat, reducer)
    names = ("observe", "set_routes" if routing_family else "pop_router_logits", "enqueue")
    originals = tuple(getattr(o, n) for o, n in zip(owner, names, strict=True))

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                direct.append(time.perf_counter() - t)

        return wrapper

    for o, n, f in zip(owner, names, originals, strict=True):
        setattr(o, n, timed(f))
    direct_steps = 3
    for _ in range(direct_steps):
        step(True, batches())
    for o, n, f in zip(owner, names, originals, strict=True):
        setattr(o, n, f)
    reads = {}
    for on in (False, True):
        with HostReadCounter() as counter:
            step(on, batches(), counter)
        reads[on] = counter.segments
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    n = s.num_microbatches
    return {
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "direct_ms_per_step": 1e3 * sum(direct) / direct_steps,
        "off_ms_median": 1e3 * statistics.median(times[False]),
        "on_ms_median": 1e3 * statistics.median(times[True]),
        "reads_per_microbatch_on_minus_off": [
            a - b for a, b in zip(reads[True][1 : n + 1], reads[False][1 : n + 1], strict=True)
        ],
        "reads_per_export_on_minus_off": reads[True][-1] - reads[False][-1],
        "keys": sorted(keys),
    }


def _details(r: dict[str, Any], ratios: list[float]) -> dict[str, Any]:
    return {
        "pairs": len(ratios),
        "step_ms_off_median": r["off_ms_median"],
        "step_ms_on_median": r["on_ms_median"],
        "ratio_p25": ratios[len(ratios) // 4],
        "ratio_p75": ratios[(3 * len(ratios)) // 4],
        "cpu_time_ratio_median": statistics.median(r["cpu_ratios"]),
        # The family's own code time per step, over the off step's median time.
        "direct_ms_per_step": r["direct_ms_per_step"],
        "direct_overhead_ratio": 1.0 + r["direct_ms_per_step"] / r["off_ms_median"],
        "host_reads_per_export_on_minus_off": r["reads_per_export_on_minus_off"],
    }


def routing_bench(step_cfg: Any, pairs: int, warmup: int = 1, timeout: float = 600.0) -> dict:
    """``routing_overhead_ratio`` and its details (one spawned rank)."""
    from nemo_moe_metrics.moe.routing import route_memory_bytes

    (r,) = ok_values(run_ranks(_rank, 1, step_cfg, pairs, warmup, timeout=timeout))
    ratios = sorted(r["ratios"])
    memory = route_memory_bytes(**MEMORY_SHAPE)
    return {
        "routing_overhead_ratio": statistics.median(ratios),
        "routing_route_bytes_94x8x32k": memory,
        "checks": {
            "routing_no_host_read_per_microbatch": all(
                v == 0 for v in r["reads_per_microbatch_on_minus_off"]
            ),
            "routing_keys_logged": "moe/routing_disagreement" in r["keys"],
        },
        "details": {
            **_details(r, ratios),
            "route_memory_shape": MEMORY_SHAPE,
            "route_memory_mib": memory / 2**20,
        },
    }


def router_health_bench(
    step_cfg: Any, pairs: int, warmup: int = 1, timeout: float = 600.0
) -> dict[str, Any]:
    """``router_health_overhead_ratio``, its host reads per microbatch, and details."""
    (r,) = ok_values(run_ranks(_rank, 1, step_cfg, pairs, warmup, "health", timeout=timeout))
    ratios = sorted(r["ratios"])
    per_microbatch = r["reads_per_microbatch_on_minus_off"]
    return {
        "router_health_overhead_ratio": statistics.median(ratios),
        "router_health_syncs_per_microbatch": int(max(per_microbatch, default=0)),
        "checks": {
            "router_health_no_host_read_per_microbatch": all(v == 0 for v in per_microbatch),
            "router_health_keys_logged": "moe/router_near_tie_fraction" in r["keys"],
        },
        "details": _details(r, ratios),
    }


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.harness import StepModel

    bench = router_health_bench if "--health" in sys.argv else routing_bench
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    print(json.dumps(bench(StepModel(), pairs=int(numbers[0]) if numbers else 10), indent=2))
