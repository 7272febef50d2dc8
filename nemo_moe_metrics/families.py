"""The metric families ``PolicyMetrics`` runs each step, behind one small protocol.

A family owns what one flag (or one source) measures: the expert loads, megatron's or the
model's own aux losses, the aux-loss-free expert bias, router health, routing consistency,
throughput and FLOPs. ``PolicyMetrics`` (``nemo_moe_metrics.metrics``) calls every family at the
same points of a step and knows none of them:

- ``enter_step`` / ``leave_step``: around ``with metrics.step():``;
- ``microbatch``: per ``metrics.microbatch()`` call (host work only, no device read);
- ``discard``: the step raised; ``restart``: its forward-backward runs again;
- ``enqueue``: launch the device work and collectives of an export and return the
  :class:`~nemo_moe_metrics.host_read.Pending` results (same order on every rank; one host
  read then brings every family's numbers back), then ``check`` the reduced numbers.

A new family is one class here (or in its own module) and one line in ``metrics.attach``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_moe_metrics.config import MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.export.host_read import Pending, collective_device, done
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.moe import aux_loss
from nemo_moe_metrics.moe.balance import ExpertLoads as BalanceLoads
from nemo_moe_metrics.moe.balance import expert_load_metrics
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.expert_bias import ExpertBiasTracker, split_layer_keys
from nemo_moe_metrics.moe.hf_aux_loss import HFAuxLossAccumulator, enqueue_hf_aux_loss_metrics
from nemo_moe_metrics.moe.imbalance_cost import busiest_rank_share
from nemo_moe_metrics.moe.overload import OverloadTracker
from nemo_moe_metrics.moe.reduction import (
    ExpertLoadReducer,
    RouterHealthReducer,
    RoutingReducer,
    default_contribute,
)
from nemo_moe_metrics.throughput import StepMeter


class MetricFamily:
    """One metric family's part in a step; every hook is a no-op unless the family needs it."""

    def enter_step(self) -> None:
        """``with metrics.step():`` begins."""

    def leave_step(self) -> None:
        """The step block ends (after ``discard`` when it raised)."""

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """Wraps the body of the step block (the step timer)."""
        yield

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        """One ``metrics.microbatch()`` call; host bookkeeping only."""

    def discard(self) -> None:
        """The open step raised: forget what it added."""

    def restart(self) -> None:
        """The open step's forward-backward runs again: forget what it added so far."""
        self.discard()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        """Launch this family's export (device ops, collectives); results come with the read."""
        return []

    def check(self, out: dict[str, Any], microbatches: int) -> None:
        """Refuse an export whose reduced numbers show misuse (same on every rank);
        ``microbatches``: this rank's ``microbatch()`` calls since the last export."""

    def end_export(self) -> None:
        """The export is over (also when it raised)."""

    def detach(self) -> None:
        """Remove the family's hooks."""


class ExpertLoads(MetricFamily):
    """Per-layer expert loads and balance (``moe/max_over_ideal``, the table, ...)."""

    def __init__(
        self,
        collector: ExpertLoadCollector | None,
        reducer: ExpertLoadReducer,
        cfg: MetricsConfig,
        ep_size: int,
    ) -> None:
        """``collector`` is None on a megatron pipeline stage without MoE layers."""
        self.collector = collector
        self.reducer = reducer
        self.cfg = cfg
        self.ep_size = ep_size
        self.busiest_share: float | None = None  # of the last export (None: no work)
        if collector is not None:
            collector.counting = False  # only inside step()

    def enter_step(self) -> None:
        if self.collector is not None:
            self.collector.counting = True

    def leave_step(self) -> None:
        if self.collector is not None:
            self.collector.counting = False

    def discard(self) -> None:
        # Also clears the collector's routing and health accumulators.
        if self.collector is not None:
            self.collector.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        loads = self.reducer.enqueue(self.collector)
        return [loads.then(self._metrics)]

    def _metrics(self, result: BalanceLoads) -> dict[str, Any]:
        widths = [result.experts_of(i) for i in range(len(result.layer_ids))]
        # The busiest EP rank's share of the step's work, for expert_imbalance_slowdown.
        self.busiest_share = (
            busiest_rank_share(result.executed_counts, self.ep_size, widths)
            if len(result.layer_ids)
            else None
        )
        return expert_load_metrics(
            result,
            per_layer=self.cfg.moe_per_layer_logging,
            table=self.cfg.log_expert_table,
            ep_size=self.ep_size,
        )

    def detach(self) -> None:
        if self.collector is not None:
            self.collector.detach()
            self.collector = None


class OverloadFactor(MetricFamily):
    """megatron-core's overload factor (``moe/{avg,max,max_cum}_overload_factor``) with expert
    parallelism, from each counted forward's executed tokens per EP rank (``moe.overload``)."""

    def __init__(
        self,
        tracker: OverloadTracker,
        collector: ExpertLoadCollector | None,
        num_layers: int,
        ep_group: Any,
        ep_rank: int,
        per_layer: bool,
    ) -> None:
        """``collector`` None: a pipeline stage without MoE layers (it joins the reduce)."""
        self.tracker = tracker
        self.collector = collector
        self.num_layers = num_layers
        self.ep_group = ep_group
        self.ep_rank = ep_rank
        self.per_layer = per_layer

    def discard(self) -> None:
        self.tracker.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        if self.collector is not None:
            self.collector.count_kept()  # the kept forwards' counts reach the tracker
        device = collective_device(self.ep_group)
        pending = self.tracker.enqueue(self.num_layers, self.ep_group, self.ep_rank, device)
        if self.per_layer:
            return [pending]
        return [pending.then(lambda out: {k: v for k, v in out.items() if "_layer_" not in k})]


class RolloutLoad(MetricFamily):
    """The expert load of the policy's own generation (``PolicyMetrics.generation()``):
    ``moe/rollout_max_over_ideal`` and per layer ``moe/layer_{i}/rollout_max_over_ideal``.

    Exported only when a generation forward was counted since the last export; every rank
    generates at the same steps (TRL's GRPO does), so the sum over ranks lines up.
    """

    def __init__(self, collector: ExpertLoadCollector, per_layer: bool) -> None:
        self.collector = collector
        self.per_layer = per_layer

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        collector = self.collector
        if not collector.rollout_seen:
            return []
        flat = torch.cat(collector.local_rollout())  # a copy: the accumulators restart at 0
        collector.reset_rollout()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        layers, sizes = collector.layer_ids, collector.num_experts
        per_layer = self.per_layer

        def finish(host: list[Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            ratios = []
            start = 0
            for layer, size in zip(layers, sizes, strict=True):
                counts = host[0][start : start + size]
                start += size
                total = int(counts.sum())
                if total == 0:
                    continue  # no generated token reached this layer: no ratio of nothing
                ratio = float(counts.max()) * size / total
                ratios.append(ratio)
                if per_layer:
                    out[mn.router_health_layer_key(layer, "rollout_max_over_ideal")] = ratio
            if ratios:
                out[mn.ROLLOUT_MAX_OVER_IDEAL] = sum(ratios) / len(ratios)
            return out

        return [Pending((flat,), finish)]


class MegatronAuxLoss(MetricFamily):
    """megatron-core's layer-wise aux-loss tracker, read with megatron's semantics."""

    def __init__(self, transformer_config: Any, cfg: MetricsConfig) -> None:
        """``cfg.aux_loss_tracker``: ``own`` (we clear the tracker) or ``shared``."""
        self.config = transformer_config
        self.cfg = cfg
        self.own = cfg.aux_loss_tracker == "own"
        self._kept: dict[str, torch.Tensor] = {}  # the tracker as step() left it
        # The tracker as it was when the open step began (device copies): restart() puts it
        # back; in shared mode it shows whether anything cleared it.
        self._at_step_start: dict[str, torch.Tensor] | None = None
        self._warned_uncleared = False

    def enter_step(self) -> None:
        if self.own:
            # The tracker as the previous steps of this export left it (empty after an
            # export): anything more came from forwards outside step(). Shared mode leaves
            # the tracker to the framework. Device ops only, no host read.
            aux_loss.restore_tracker(self._kept)
        self._at_step_start = aux_loss.tracker_snapshot()

    def leave_step(self) -> None:
        self._kept = aux_loss.tracker_snapshot()

    def discard(self) -> None:
        self._kept = {}
        if self.own:  # shared: the tracker is the framework's; its own report decides
            aux_loss.clear_aux_loss_tracker()

    def restart(self) -> None:
        if self._at_step_start is not None:
            aux_loss.restore_tracker(self._at_step_start)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        pending = [
            aux_loss.enqueue_aux_loss_metrics(
                self.config,
                num_microbatches=num_microbatches,
                per_layer=self.cfg.moe_per_layer_logging,
                tracker=self.cfg.aux_loss_tracker,
            )
        ]
        if not self.own:
            pending.append(self._enqueue_uncleared_check())
        return pending

    def end_export(self) -> None:
        self._kept = {}
        self._at_step_start = None

    def _enqueue_uncleared_check(self) -> Pending[dict[str, Any]]:
        # Shared mode: the framework's report clears megatron's tracker after finish_step. If the
        # tracker held anything when this step began, nothing did, and values pile up over steps.
        start = self._at_step_start
        if self._warned_uncleared or not start:
            return done({})
        total = torch.stack([v.detach().float().abs().sum() for v in start.values()]).sum()

        def finish(host: list[Any]) -> dict[str, Any]:
            held = float(host[0].reshape(-1)[0])
            if held != 0.0 and not self._warned_uncleared:
                self._warned_uncleared = True
                warnings.warn(
                    f"aux_loss_tracker: shared, but megatron's aux-loss tracker still held values "
                    f"(sum {held:.4g}) when this step began: nothing cleared it after the previous "
                    "step, so megatron's and our moe/ aux losses add up over steps. Call "
                    "megatron's report after finish_step every step (track_moe_metrics on "
                    "megatron-core 0.16, get_moe_metrics_tracker().report on 0.19, as the "
                    "training_log of Megatron-Bridge and Megatron-LM does), or set "
                    "aux_loss_tracker: own to let nemo_moe_metrics clear it.",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return {}

        return Pending((total.reshape(1),), finish)


class ModelAuxLoss(MetricFamily):
    """A transformers model's own load-balancing loss per layer, from its router logits."""

    def __init__(self, accumulator: HFAuxLossAccumulator, cfg: MetricsConfig) -> None:
        """``accumulator`` is fed by router hooks that the collector gates."""
        self.accumulator = accumulator
        self.cfg = cfg

    def discard(self) -> None:
        self.accumulator.reset()

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [
            enqueue_hf_aux_loss_metrics(
                self.accumulator,
                self.accumulator.layers,
                num_microbatches=num_microbatches,
                per_layer=self.cfg.moe_per_layer_logging,
            )
        ]


class ExpertBias(MetricFamily):
    """The aux-loss-free expert bias (``moe/expert_bias_*``); every rank joins its reduce."""

    def __init__(self, tracker: ExpertBiasTracker, loads: ExpertLoads, per_layer: bool) -> None:
        """Enqueued after ``loads``: their first export agrees the layers."""
        self.tracker = tracker
        self.loads = loads
        self.per_layer = per_layer

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        per_layer = self.per_layer
        return [
            self.tracker.enqueue(self.loads.reducer.layer_ids).then(
                lambda bias: split_layer_keys(bias, per_layer)
            )
        ]


class RouterHealth(MetricFamily):
    """How confident and fragile the routers' decisions are (``moe/router_*``)."""

    def __init__(self, loads: ExpertLoads, cfg: MetricsConfig) -> None:
        """Enqueued after ``loads``: their first export agrees the layers."""
        collector = loads.collector
        self.loads = loads
        self.cfg = cfg
        self.tracker = collector.enable_health(cfg.router_near_tie_gap) if collector else None
        self.reducer = RouterHealthReducer(None)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        reducer = self.loads.reducer
        return [
            self.reducer.enqueue(
                self.tracker,
                reducer.layer_ids,
                reducer.topks,
                per_layer=self.cfg.moe_per_layer_logging,
                contribute=default_contribute(self.loads.collector),
            )
        ]


class RoutingConsistency(MetricFamily):
    """The rollout engine's routes against the training routers' (``moe/routing_*``)."""

    def __init__(
        self,
        collector: ExpertLoadCollector | None,
        moe_layers: list[int],
        topk: int,
        rollout_experts: int,
        cfg: MetricsConfig,
    ) -> None:
        """``moe_layers``: the decoder's MoE layers, the layer axis of the rollout routes."""
        self.collector = collector
        self.cfg = cfg
        self.tracker = (
            collector.enable_routing(moe_layers, rollout_experts=rollout_experts)
            if collector is not None
            else None
        )
        self.reducer = RoutingReducer(moe_layers, topk, rollout_experts=rollout_experts)

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        if self.tracker is not None:
            self.tracker.set_routes(rollout_routes, num_sequences=num_sequences)

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [
            self.reducer.enqueue(
                self.tracker,
                per_layer=self.cfg.moe_per_layer_logging,
                contribute=default_contribute(self.collector),
            )
        ]


_INPUT_KEYS = ("input_ids", "tokens", "inputs_embeds", "input")


def _input_rows_and_width(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """``(sequences, positions per sequence)`` of a model's token input, from its shape."""
    found = next((kwargs[k] for k in _INPUT_KEYS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if found is None and args and isinstance(args[0], torch.Tensor):
        found = args[0]
    if found is None or found.dim() < 2 or found.is_floating_point() and found.dim() < 3:
        return None  # no [batch, seq] token ids (or [batch, seq, hidden] embeddings) to read
    return int(found.shape[0]), int(found.shape[1])


class Throughput(MetricFamily):
    """Step time, tokens and FLOPs (``train_perf/``), from a :class:`StepMeter`."""

    def __init__(self, meter: StepMeter, chunks: list[nn.Module]) -> None:
        """Hooks each chunk's forward to see the batch a microbatch's lengths were for."""
        self.meter = meter
        self._in_step = False
        # len(seq_lens) of the last microbatch() call until a training forward of a chunk
        # shows the batch it was for (see _note_model_input).
        self._awaiting_forward: int | None = None
        self._hooks = [
            chunk.register_forward_pre_hook(self._note_model_input, with_kwargs=True)
            for chunk in chunks
        ]

    def enter_step(self) -> None:
        self._in_step = True
        self._awaiting_forward = None

    def leave_step(self) -> None:
        self._in_step = False

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        with self.meter.step():
            yield

    def microbatch(self, seq_lens: Any, rollout_routes: Any, num_sequences: int | None) -> None:
        self.meter.add_sequences(seq_lens)
        self._awaiting_forward = num_sequences

    def restart(self) -> None:
        self.meter.discard_step_sequences()
        self._awaiting_forward = None

    def enqueue(self, num_microbatches: int) -> list[Pending[dict[str, Any]]]:
        return [self.meter.enqueue()]

    def check(self, out: dict[str, Any], microbatches: int) -> None:
        # out holds the tokens already reduced over every rank (read at export anyway), so
        # every rank takes this branch together; only then one more tiny collective asks
        # whether any rank called microbatch() (zero-length sequences are a valid 0 tokens).
        if out.get(mn.TOKENS) != 0:
            return
        calls = microbatches
        if dist.is_available() and dist.is_initialized():
            total = torch.tensor([calls], dtype=torch.int64, device=collective_device())
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            calls = int(total.item())
        if calls == 0:
            raise RuntimeError(
                "PolicyMetrics.finish_step: track_throughput is on but no rank called "
                "microbatch() since the last finish_step, so train_perf/ would report 0 tokens. "
                "Call metrics.microbatch(seq_lens=...) once per microbatch inside "
                "`with metrics.step():` (e.g. in forward_step_func)."
            )

    def _note_model_input(self, chunk: nn.Module, args: tuple, kwargs: dict) -> None:
        # The first training forward of a chunk after microbatch() shows the batch the lengths
        # were for: its input's shape (metadata only, no host read). One length per row; a
        # single row ([1, total], THD packing) holds any number of packed sequences.
        if not (self._in_step and chunk.training and torch.is_grad_enabled()):
            return  # a no-grad or eval forward (reference scoring) is not the microbatch's
        count, self._awaiting_forward = self._awaiting_forward, None
        if count is None:
            return
        rows_and_width = _input_rows_and_width(args, kwargs)
        if rows_and_width is None:  # e.g. a middle pipeline stage (no token input)
            return
        rows, width = rows_and_width
        if compat.context_parallel_size() == 1:  # a CP rank's input holds part of each sequence
            self.meter.note_positions(rows * width)
        if count != rows and rows > 1:
            self.meter.reject(
                f"microbatch(seq_lens=...) got {count} length(s) but the model's next forward "
                f"took a batch of {rows} sequences ({rows} x {width}); pass one real-token "
                "count per sequence of that batch, e.g. attention_mask.sum(-1) (sequences "
                "packed into one row, [1, total], pass one length per packed sequence)"
            )

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
