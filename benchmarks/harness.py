"""The measurements behind ``benchmarks/run.py``: what runs on each gloo rank, and the FLOP timing.

Rank side (spawned gloo ranks, one torch thread each):

1. Step overhead (:func:`step_rank`, one rank): one megatron-core MoE GPTModel trained by
   megatron-core's own ``get_forward_backward_func()`` schedule plus AdamW, stepped alternately
   under a :class:`~nemo_moe_metrics.worker.PolicyMetrics` with every flag on (its hooks in
   place) and one with every flag off (the hooks removed, so the model runs as never hooked).
   Steps alternate off/on and on/off (ABBA) on the same batch, so slow drifts of a shared machine
   hit both alike. One rank on one core leaves the second core
   to the machine's other load; two ranks filling both cores made every preemption land on a
   step (A/A ratios from 0.85 to 1.5 under a load average of 2-4).
2. Host reads (counted, not timed): one more step of each model under
   :class:`~benchmarks.host_reads.HostReadCounter`, segmented per microbatch; the metrics' cost is
   the difference on minus off, so megatron's own reads cancel.
3. Export (:func:`export_rank`, two ranks): a 40-layer x 256-expert model of registered top-k
   routers (the real hook path); each repeat routes a batch (untimed), then times reduce +
   normalise + table; the time of a repeat is the slower rank's.

Parent side: the vectorised FLOP estimate for 4,096 mixed-length sequences against a loop that
calls the same estimator once per sequence.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from nemo_moe_metrics.testing import ok_values, run_ranks


# ------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class StepModel:
    """The megatron-core MoE GPT model and batch of the step benchmark."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_experts: int = 32
    topk: int = 4
    moe_ffn_hidden_size: int = 256
    vocab_size: int = 2048
    # The example uses 2 x 512 tokens per microbatch: about 2.9 s a step on one core
    # here. 2 x 64 gives about 550 ms ("a few hundred ms"), so more pairs fit and a burst of
    # other load more often covers both steps of a pair. --seq-length 512 runs the example.
    seq_length: int = 64
    micro_batch_size: int = 2
    num_microbatches: int = 4
    # Aux-loss-free balancing on (megatron's router.expert_bias, moved after every step by
    # megatron's own update): the on variant also exports moe/expert_bias_* (issue 22).
    expert_bias: bool = True


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repeats of one benchmark run (see ``run.py`` for the presets)."""

    step: StepModel = field(default_factory=StepModel)
    warmup_pairs: int = 1
    pairs: int = 8
    export_layers: int = 40
    export_experts: int = 256
    export_topk: int = 8
    export_tokens: int = 256  # tokens each rank routes per export repeat
    export_ep_size: int = 2
    export_repeats: int = 20
    threads: int = 1
    seed: int = 1234
    # Which metrics the "on" model gets: "all" (the benchmark), or for attributing a cost,
    # "moe" (expert load + aux losses), "throughput" (step meter + FLOPs), "none" (an A/A run:
    # two identical models without metrics, showing the noise floor of the ratio).
    on: str = "all"
    direct_steps: int = 3  # steps of the on model with its own code timed from inside


# ------------------------------------------------------------------------------- spawning
def _quiet(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    import warnings

    # megatron-core's notices about optional CUDA libraries, repeated by every rank.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    warnings.filterwarnings("ignore", message=r"Using a large number of experts")
    return fn(rank, world_size, *args)


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float, threads: int = 1
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on spawned gloo ranks; their results by rank.

    Raises RuntimeError with every failed rank's traceback, TimeoutError past ``timeout`` s.
    """
    results = run_ranks(_quiet, world_size, fn, *args, timeout=timeout, threads=threads)
    return ok_values(results)


# ------------------------------------------------------------------------------- rank side
def step_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict[str, Any]:
    """Step times (wall and CPU) of interleaved off/on pairs, then the host-read counts."""
    torch.set_num_threads(cfg.threads)
    from nemo_moe_metrics.config import MegatronConfig
    from nemo_moe_metrics.megatron.model import init_distributed

    init_distributed(MegatronConfig(), seed=cfg.seed)
    step = StepBench(cfg, rank, world_size)
    out: dict[str, Any] = {"step": step.run_pairs()}
    out["direct"] = step.account_direct_costs(cfg.direct_steps)
    out["families"] = step.account_family_costs(cfg.direct_steps)
    out["host_reads"] = step.count_host_reads()
    step.close()
    return out


def export_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict[str, Any]:
    """Export times of the 40 x 256 router model and its host reads."""
    torch.set_num_threads(cfg.threads)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return _export_bench(cfg, rank, world_size)


class _Variant:
    """The step-bench model under one PolicyMetrics: every flag on, or every flag off."""

    def __init__(self, name: str, metrics: Any) -> None:
        self.name = name
        self.metrics = metrics
        self.counter: Any = None  # a HostReadCounter while counting


class _PackageHooks:
    """Removes and restores the forward hooks nemo_moe_metrics put on a model.

    Off-steps run the model exactly as an unhooked one (no hooks: ``nn.Module`` takes its fast
    path), on-steps with the hooks ``PolicyMetrics.attach`` registered, in their order. Methods
    wrapped on an instance (router health's capture of megatron's ``gating``) come and go too.
    """

    def __init__(self, model: nn.Module) -> None:
        self._wrapped = [
            (module, name, fn)
            for module in model.modules()
            for name, fn in list(vars(module).items())
            if callable(fn) and not isinstance(fn, nn.Module) and _is_package_hook(fn)
        ]
        self._saved = []
        for module in model.modules():
            for hooks in (module._forward_hooks, module._forward_pre_hooks):
                ours = [i for i, fn in hooks.items() if _is_package_hook(fn)]
                if ours:
                    self._saved.append((hooks, list(hooks.items()), ours))
        self.count = sum(len(ours) for _, _, ours in self._saved)
        self.enabled = True

    def enable(self, on: bool) -> None:
        """Hooks in place (True) or removed (False); a no-op when already so."""
        if on == self.enabled:
            return  # keeps whatever wraps the hooks meanwhile (the direct-cost timers)
        self.enabled = on
        for module, name, fn in self._wrapped:
            if on:
                setattr(module, name, fn)
            else:
                module.__dict__.pop(name, None)
        for hooks, items, ours in self._saved:
            if on:
                hooks.clear()
                hooks.update(items)
            else:
                for hook_id in ours:
                    hooks.pop(hook_id, None)


def _is_package_hook(fn: Any) -> bool:
    return getattr(fn, "__module__", "").startswith("nemo_moe_metrics.")


class StepBench:
    """One megatron-core MoE GPTModel stepped alternately with the metrics on and off.

    One model for both variants: in an A/A run two separately built copies with the same weights
    gave 0.977 (95% CI 0.934-0.996), from where their tensors landed in memory: the size of the
    effect measured here.
    """

    def __init__(self, cfg: BenchConfig, rank: int, world_size: int) -> None:
        from nemo_moe_metrics import PolicyMetrics
        from nemo_moe_metrics.config import MegatronConfig, MetricsConfig, ModelConfig
        from nemo_moe_metrics.megatron.model import (
            build_gpt_model,
            build_transformer_config,
            causal_attention_mask,
        )

        s = cfg.step
        self.cfg, self.rank, self.world = cfg, rank, world_size
        megatron_cfg = MegatronConfig()
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
            moe_router_enable_expert_bias=s.expert_bias,
        )
        self.transformer_config = build_transformer_config(model_cfg, megatron_cfg)
        torch.manual_seed(cfg.seed)
        self.model = build_gpt_model(model_cfg, megatron_cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        moe = cfg.on in ("all", "moe")
        throughput = cfg.on in ("all", "throughput")
        on_flags = MetricsConfig(
            track_moe_metrics=moe,
            moe_per_layer_logging=moe,
            track_throughput=throughput,
            track_flops=throughput,
            track_router_health=moe,
            track_routing_consistency=moe,
            log_expert_table=True,
            # No accelerator to look up on CPU; any positive peak exercises the MFU path.
            peak_flops_per_gpu=1e12 if throughput else None,
        )
        metrics_on = PolicyMetrics(on_flags, vocab_size=s.vocab_size)
        metrics_off = PolicyMetrics(MetricsConfig(), vocab_size=s.vocab_size)
        metrics_off.attach(self.model, self.transformer_config)  # attaches nothing
        metrics_on.attach(self.model, self.transformer_config)
        self.hooks = _PackageHooks(self.model)
        if (
            metrics_on.active != (cfg.on != "none")
            or metrics_off.active
            or (self.hooks.count > 0) != moe
        ):
            raise RuntimeError(f"benchmark setup: on={cfg.on!r} does not match the metrics built")
        self.variants = {"off": _Variant("off", metrics_off), "on": _Variant("on", metrics_on)}
        self.mask = causal_attention_mask(s.seq_length)
        self.position_ids = torch.arange(s.seq_length).expand(s.micro_batch_size, s.seq_length)
        self.gen = torch.Generator().manual_seed(cfg.seed + rank)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per microbatch: tokens, loss mask, and rollout routes (``[b, s, layers, top_k]``,
        distinct random experts per token: what an engine's routed_experts look like)."""
        s = self.cfg.step
        shape = (s.micro_batch_size, s.seq_length)
        routes_shape = (*shape, s.num_layers, s.num_experts)
        return [
            (
                torch.randint(0, s.vocab_size, shape, generator=self.gen),
                torch.ones(shape, dtype=torch.int64),  # loss mask: every token is real
                torch.rand(routes_shape, generator=self.gen).argsort(dim=-1)[..., : s.topk],
            )
            for _ in range(s.num_microbatches)
        ]

    def _forward_step(self, variant: _Variant) -> Callable:
        def forward_step(data_iterator, model):
            if variant.counter is not None:
                variant.counter.mark()  # a new microbatch starts here
            tokens, loss_mask, routes = next(data_iterator)
            # What a policy worker does per microbatch: real lengths (and, with routing
            # consistency on, the rollout's routes), on device, no sync.
            if variant.name == "on" and self.cfg.on in ("all", "moe"):
                variant.metrics.microbatch(seq_lens=loss_mask.sum(-1), rollout_routes=routes)
            else:
                variant.metrics.microbatch(seq_lens=loss_mask.sum(-1))
            output = model(tokens, self.position_ids, self.mask, labels=tokens)

            def loss_func(output_tensor):
                loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        return forward_step

    def step(self, variant: _Variant, batches: list) -> tuple[float, float, float, dict[str, Any]]:
        """One timed optimizer step: (wall seconds, CPU seconds, finish_step seconds, metrics)."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode
        from nemo_moe_metrics.moe.aux_loss import clear_aux_loss_tracker

        s = self.cfg.step
        self.hooks.enable(variant.name == "on")
        # Off-steps' routers also write megatron's module-level tracker: start each step clean
        # (untimed), so the on variant reads only its own step.
        clear_aux_loss_tracker()
        forward_step = self._forward_step(variant)
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        with variant.metrics.step():
            with cpu_device_mode():
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(batches),
                    model=[self.model],
                    num_microbatches=s.num_microbatches,
                    seq_length=s.seq_length,
                    micro_batch_size=s.micro_batch_size,
                    forward_only=False,
                )
            if variant.counter is not None:
                variant.counter.mark()  # microbatches done: optimizer and step exit follow
            if s.expert_bias:  # what finalize_model_grads does before the optimizer step
                from megatron.core.distributed.finalize_model_grads import (
                    _update_router_expert_bias,
                )

                _update_router_expert_bias([self.model], self.transformer_config)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if variant.counter is not None:
            variant.counter.mark()  # the export
        metrics = variant.metrics.finish_step(num_microbatches=s.num_microbatches)
        t2 = time.perf_counter()
        return t2 - t0, time.process_time() - c0, t2 - t1, metrics

    def run_pairs(self) -> dict[str, Any]:
        """Warm-up pairs, then ``pairs`` interleaved off/on steps; per-step seconds."""
        times: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        finish: list[float] = []
        last_on: dict[str, Any] = {}
        for i in range(self.cfg.warmup_pairs + self.cfg.pairs):
            batches = self.batches()  # the same batch for both variants of a pair
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for name in order:
                seconds, cpu_seconds, finish_seconds, metrics = self.step(
                    self.variants[name], batches
                )
                if i < self.cfg.warmup_pairs:
                    continue
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                if name == "on":
                    finish.append(finish_seconds)
                    last_on = metrics
                elif metrics:
                    raise RuntimeError(f"metrics off returned {sorted(metrics)[:3]}...")
        return {
            "off_s": times["off"],
            "on_s": times["on"],
            "off_cpu_s": cpu["off"],
            "on_cpu_s": cpu["on"],
            "finish_on_s": finish,
            **self._checks(last_on),
        }

    def _checks(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Facts about the on variant's last step, recomputed here, so a broken path shows."""
        from nemo_moe_metrics.export import metric_names as mn

        if self.cfg.on != "all":
            return {"metric_keys": len(metrics)}  # ablation runs: the full run checks
        s = self.cfg.step
        tokens = self.world * s.num_microbatches * s.micro_batch_size * s.seq_length
        rows = metrics.get(mn.EXPERT_LOADS, [])
        per_layer: dict[int, int] = {}
        for layer, _, count, _ in rows:
            per_layer[layer] = per_layer.get(layer, 0) + count
        return {
            "metric_keys": len(metrics),
            "check_tokens": metrics.get(mn.TOKENS) == float(tokens),
            "check_table_rows": len(rows) == s.num_layers * s.num_experts,
            "check_assignments": per_layer == {i: tokens * s.topk for i in range(s.num_layers)},
            "check_flops": metrics.get(mn.ESTIMATED_FLOPS, 0.0) > 0,
            "check_aux_loss": 0.5 < metrics.get("moe/load_balancing_loss", 0.0) < 4.0,
            "check_expert_bias": (mn.EXPERT_BIAS_RANGE in metrics) == s.expert_bias,
            "check_routing": mn.ROUTING_DISAGREEMENT in metrics,
        }

    def account_direct_costs(self, steps: int) -> dict[str, list[float]]:
        """Seconds spent inside the metrics' own code per on-step, timed from inside.

        Each router/chunk hook of the collector and ``PolicyMetrics.microbatch`` is wrapped in a
        timer (the timers' own cost counts against the metrics); ``finish_step`` is timed as a
        whole. Unlike the on/off ratio, this sum is nearly blind to other processes' load, but
        it cannot see indirect costs (e.g. a hook keeping a tensor alive).
        """
        variant = self.variants["on"]
        hooks, microbatch = [0.0], [0.0]
        self.hooks.enable(True)
        restore, wrapped = wrap_package_hooks(self.model, hooks)
        if self.cfg.on in ("all", "moe") and not wrapped:
            restore()
            raise RuntimeError("benchmark: no nemo_moe_metrics hooks on the on-model to time")
        variant.metrics.microbatch = timed_call(variant.metrics.microbatch, microbatch)
        out: dict[str, list[float]] = {"hooks_s": [], "microbatch_s": [], "finish_s": []}
        try:
            for _ in range(steps):
                hooks[0] = microbatch[0] = 0.0
                _, _, finish_seconds, _ = self.step(variant, self.batches())
                out["hooks_s"].append(hooks[0])
                out["microbatch_s"].append(microbatch[0])
                out["finish_s"].append(finish_seconds)
        finally:
            restore()
            del variant.metrics.microbatch
        return out

    def account_family_costs(self, steps: int) -> dict[str, list[float]]:
        """CPU seconds of each metric family's own code per on-step (``metrics.families``).

        Each family's step calls (enter, leave, ``microbatch``, ``enqueue`` and the host
        arithmetic of its ``Pending``, ``check``, ``end_export``) are timed with the process's
        CPU clock; the router hooks go to the family whose code runs in them: router health's
        and routing consistency's ``observe``, throughput's input hook, and the rest of the
        collector's hooks (counting, the hook's dispatch, reading the captured logits) to the
        expert loads. Nearly blind to other processes' load; not timed: the step timer's
        context (throughput's ``around_step``), indirect costs (memory kept alive).
        """
        from nemo_moe_metrics.export.host_read import Pending

        metrics = self.variants["on"].metrics
        families = list(metrics._families)
        spent = {type(f).__name__: [0.0] for f in families}
        undo: list[Callable[[], None]] = []

        def wrap(owner: Any, name: str, bucket: list[float]) -> None:
            original = getattr(owner, name)
            setattr(owner, name, _cpu_timed(original, bucket))
            undo.append(lambda: delattr(owner, name))

        def timed_enqueue(enqueue: Callable, bucket: list[float]) -> Callable:
            def enqueue_timed(n: int) -> list[Any]:
                pending = _cpu_timed(enqueue, bucket)(n)
                return [Pending(p.tensors, _cpu_timed(p.finish, bucket), p.fence) for p in pending]

            return enqueue_timed

        for family in families:
            bucket = spent[type(family).__name__]
            for name in ("enter_step", "leave_step", "microbatch", "check", "end_export"):
                wrap(family, name, bucket)
            family.enqueue = timed_enqueue(family.enqueue, bucket)
            undo.append(lambda f=family: delattr(f, "enqueue"))
        nested = [0.0]  # health / routing observe inside the collector's hooks
        for family in families:
            # Their trackers' observe runs in the collector's hooks (their subscriptions).
            tracker = getattr(family, "tracker", None)
            if type(family).__name__ in ("RouterHealth", "RoutingConsistency") and tracker:
                inner = _cpu_timed(tracker.observe, spent[type(family).__name__])
                tracker.observe = _cpu_timed(inner, nested)
                undo.append(lambda t=tracker: delattr(t, "observe"))
        hooks, throughput_hooks = [0.0], spent.get("Throughput", [0.0])
        self.hooks.enable(True)
        restore, _ = wrap_package_hooks(self.model, hooks, throughput_hooks, time.process_time)
        out: dict[str, list[float]] = {name: [] for name in spent}
        try:
            for _ in range(steps):
                for bucket in (*spent.values(), hooks, nested):
                    bucket[0] = 0.0
                self.step(self.variants["on"], self.batches())
                if "ExpertLoads" in spent:
                    spent["ExpertLoads"][0] += hooks[0] - nested[0]
                for name, bucket in spent.items():
                    out[name].append(bucket[0])
        finally:
            restore()
            for fn in reversed(undo):
                fn()
        return out

    def count_host_reads(self) -> dict[str, Any]:
        """Host reads of one step of each variant, per segment (counted, not timed)."""
        from benchmarks.host_reads import HostReadCounter

        batches = self.batches()
        out: dict[str, Any] = {}
        for name in ("off", "on"):
            variant = self.variants[name]
            with HostReadCounter() as counter:
                variant.counter = counter
                try:
                    self.step(variant, batches)
                finally:
                    variant.counter = None
            segments = counter.segments
            n = self.cfg.step.num_microbatches
            # segments: [step entry, microbatch 1..n, optimizer + step exit, finish_step]
            if len(segments) != n + 3:
                raise RuntimeError(f"expected {n + 3} host-read segments, got {len(segments)}")
            out[name] = {
                "step_entry": segments[0],
                "microbatches": segments[1 : n + 1],
                "step_exit": segments[n + 1],
                "export": segments[n + 2],
                "by_site": counter.by_site,
            }
        return out

    def close(self) -> None:
        self.hooks.enable(True)
        for v in self.variants.values():
            v.metrics.detach()
        self.variants.clear()


def timed_call(
    fn: Callable, acc: list[float], clock: Callable[[], float] = time.perf_counter
) -> Callable:
    """``fn`` that adds the ``clock`` time of each call to ``acc[0]``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += clock() - t0

    return timed


def _cpu_timed(fn: Callable, acc: list[float]) -> Callable:
    return timed_call(fn, acc, time.process_time)


def wrap_package_hooks(
    model: nn.Module,
    acc: list[float],
    throughput_acc: list[float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Callable[[], None], int]:
    """Time every forward (pre-)hook the package registered on ``model``; (undo, hooks timed).

    ``throughput_acc``: where throughput's input hook goes (default: ``acc`` with the rest).
    """
    replaced: list[tuple[dict, int, Callable]] = []
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for hook_id, fn in list(hooks.items()):
                if _is_package_hook(fn):
                    replaced.append((hooks, hook_id, fn))
                    owner = getattr(fn, "__qualname__", "")
                    into = acc
                    if throughput_acc is not None and owner.startswith("Throughput."):
                        into = throughput_acc
                    hooks[hook_id] = timed_call(fn, into, clock)

    def restore() -> None:
        for hooks, hook_id, fn in replaced:
            hooks[hook_id] = fn

    return restore, len(replaced)


class BenchRouter(nn.Module):
    """A top-k softmax router returning ``(logits, weights, indices)`` like Hugging Face's."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        weights, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights, indices


class _RouterLayer(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = BenchRouter(hidden, num_experts, top_k)


class BenchRouterModel(nn.Module):
    """``layers.{i}.router`` for every layer: routers only, so routing a batch costs little."""

    def __init__(self, layers: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RouterLayer(hidden, num_experts, top_k) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            layer.router(x)
        return x


def _index_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    """counts_fn for BenchRouter: a fixed-size scatter_add of the top-k indices (no host read)."""
    flat = output[2].reshape(-1)
    counts = torch.zeros(module.num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts, output[2].shape[0]


def _export_bench(cfg: BenchConfig, rank: int, world_size: int) -> dict[str, Any]:
    """Reduce + normalise + table of ``export_layers x export_experts`` on every rank."""
    import torch.distributed as dist

    from benchmarks.host_reads import HostReadCounter
    from nemo_moe_metrics import attach_collector, register_router
    from nemo_moe_metrics.moe.balance import expert_load_metrics
    from nemo_moe_metrics.moe.reduction import ExpertLoadReducer, export_expert_loads

    register_router(BenchRouter, _index_counts)
    hidden = 32
    torch.manual_seed(cfg.seed)
    model = BenchRouterModel(cfg.export_layers, hidden, cfg.export_experts, cfg.export_topk)
    collector = attach_collector(model)
    if collector is None or len(collector.layer_ids) != cfg.export_layers:
        raise RuntimeError("export benchmark: the router hooks were not attached")
    reducer = ExpertLoadReducer(None)
    gen = torch.Generator().manual_seed(cfg.seed + 100 + rank)

    def route() -> None:
        # A training forward (train mode, autograd on) is what the collector counts.
        model(torch.randn(cfg.export_tokens, hidden, generator=gen))

    def export() -> tuple[float, float, dict[str, Any]]:
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loads = export_expert_loads(collector, reducer=reducer)
        metrics = expert_load_metrics(loads, per_layer=True, table=True, ep_size=cfg.export_ep_size)
        return time.perf_counter() - t0, time.process_time() - c0, metrics

    model.train()
    route()
    first_s, _, _ = export()  # agrees on the layer signature (all_gather_object) once
    times, cpu_times = [], []
    metrics: dict[str, Any] = {}
    for _ in range(cfg.export_repeats):
        route()
        seconds, cpu_seconds, metrics = export()
        times.append(seconds)
        cpu_times.append(cpu_seconds)
    route()
    with HostReadCounter() as counter:
        export()
    collector.detach()
    from nemo_moe_metrics.export import metric_names as mn

    rows = metrics.get(mn.EXPERT_LOADS, [])
    assigned = sum(r[2] for r in rows)
    expected = world_size * cfg.export_tokens * cfg.export_topk * cfg.export_layers
    return {
        "first_s": first_s,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "host_reads": counter.total,
        "host_read_sites": counter.by_site,
        "check_table_rows": len(rows) == cfg.export_layers * cfg.export_experts,
        "check_assignments": assigned == expected,
    }


# ------------------------------------------------------------------------------- parent side
def mixed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` sequence lengths mixing short prompts and long documents (1 to 8,192 tokens)."""
    rng = np.random.default_rng(seed)
    # Log-uniform: as many 10-100 token sequences as 1,000-8,192 token ones.
    return np.exp(rng.uniform(0.0, np.log(8192), size=n)).astype(np.int64).clip(1, 8192)


def flops_bench(
    fixtures: dict[str, str], num_sequences: int, repeats: int, loop_repeats: int
) -> dict[str, Any]:
    """Vectorised estimate of ``num_sequences`` lengths vs one estimator call per sequence."""
    from nemo_moe_metrics.flops import get_flops_estimator, load_fixture

    lengths = mixed_lengths(num_sequences)
    as_list = lengths.tolist()
    out: dict[str, Any] = {}
    for label, fixture in fixtures.items():
        est = get_flops_estimator(load_fixture(fixture))
        est(lengths)  # warm numpy's paths once
        vec = _time_repeats(lambda est=est: est(lengths), repeats)
        from_list = _time_repeats(lambda est=est: est(as_list), repeats)

        def loop(est=est) -> float:
            return sum(est([length]).total for length in as_list)

        loop_times = _time_repeats(loop, loop_repeats)
        vectorised_total = est(lengths).total
        looped_total = loop()
        out[label] = {
            "fixture": fixture,
            "model_type": load_fixture(fixture).get("model_type"),
            "vectorised_ms": 1e3 * statistics.median(vec),
            "vectorised_from_list_ms": 1e3 * statistics.median(from_list),
            "loop_ms": 1e3 * statistics.median(loop_times),
            "speedup": statistics.median(loop_times) / statistics.median(vec),
            # The loop computes the same formula: the totals agree to float rounding.
            "check_same_total": abs(vectorised_total - looped_total) <= 1e-9 * looped_total,
            "total_flops": vectorised_total,
        }
    return out


def _time_repeats(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
