"""The collector: router forward hooks that count expert assignments on the device, no host syncs.

It knows no model family: each router comes with its :class:`~nemo_moe_metrics.moe.router_spec.
RouterSpec` (``nemo_moe_metrics.adapters`` finds them). How counting works (details and limits:
docs/en/expert_load.md):

- ``attach_collector(model_chunks)`` (``adapters.registry``) finds every known router
  (megatron-core ``TopKRouter``, torchtitan's ``TokenChoiceTopKRouter``, every Hugging Face
  experts module through transformers' shared experts interface, or a class given to
  ``register_router``) and :meth:`ExpertLoadCollector.hook` adds one forward hook per MoE layer
  plus a pre/post hook pair on each model chunk. Multi-token-prediction layers count as layers
  ``num_layers + j``.
- The chunk hooks mark a *training forward*: the chunk is in ``train()`` mode, autograd is on at
  the chunk's entry and we are not inside a backward pass. Routers count only inside such a
  forward. This is what makes activation recomputation safe: megatron's ``full`` recompute runs
  the first forward with grad disabled inside a checkpoint function (still inside the chunk's
  training forward: counted) and replays it during backward (the chunk forward is over and
  autograd's graph task is active: not counted). Reference-model / rollout log-probs under
  ``torch.no_grad()`` or ``eval()`` are never counted.
- Real tokens only: a router whose spec says ``padding_from_model`` (Hugging Face routers see
  no mask) gets the real-token mask of the model forward it serves: the chunk's 2-D
  ``attention_mask`` (1 = real token), its last ``width`` columns for a forward of ``width``
  positions (a decode step's own token). A forward without one (packed ``position_ids``,
  unpadded batches) holds no padding. The mask is a view and one device op; nothing is read.
- A *generation* (``rollout_counting``, set by ``PolicyMetrics.generation()``): forwards that
  are not training forwards count into per-layer rollout accumulators instead, real tokens
  only, never into the training counts; given the end-of-sequence ids, no position after a
  sequence's end either (``moe.generation_mask``: ``generate`` feeds padding there with mask 1).
- ``counting`` scopes it to a step: ``PolicyMetrics`` sets it on entering ``step()`` and clears
  it on leaving, so a training forward outside ``step()`` is not counted into any step. A
  collector used on its own counts whenever the rules above hold (``counting`` stays True).
- Counts accumulate as int64 per layer on the router's device; the hook path only launches
  device ops (no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or branching on values).
- It knows no metric family either: a family that needs more of a router forward than its
  counts (router health, routing consistency, the overload factor) subscribes with
  :meth:`ExpertLoadCollector.subscribe` and sees each forward, each batch of kept forwards
  counted together, and each reset (``moe.subscriptions``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nemo_moe_metrics.moe.deferred import FLUSH_BYTES, ConstantTensors, HostStaging
from nemo_moe_metrics.moe.generation_mask import EndOfSequence
from nemo_moe_metrics.moe.layer_counts import (
    KeptPicks,
    LayerAccumulator,
    LayerBuffers,
    forward_counts,
)
from nemo_moe_metrics.moe.reduction import ExpertLoadReducer
from nemo_moe_metrics.moe.router_spec import (
    RouterSpec,
    in_backward,
    layer_id_from_name,
    mtp_index,
    per_expert,
    same_layer_message,
)
from nemo_moe_metrics.moe.subscriptions import (
    GENERATION,
    TRAINING,
    CountedForwards,
    ForwardObserver,
    HookedRouter,
    RouterForward,
)

if TYPE_CHECKING:
    from nemo_moe_metrics.moe.balance import ExpertLoads


_FORWARD_PARAMS: dict[type, list[str]] = {}


def _forward_params(chunk: nn.Module) -> list[str]:
    # Positional argument names of the chunk's forward (input_ids, attention_mask, ...), once
    # per class, so a mask passed positionally is found too.
    cls = type(chunk)
    if cls not in _FORWARD_PARAMS:
        try:
            names = list(inspect.signature(cls.forward).parameters)[1:]
        except (TypeError, ValueError):
            names = []
        _FORWARD_PARAMS[cls] = names
    return _FORWARD_PARAMS[cls]


def _forward_inputs(
    chunk: nn.Module, args: tuple, kwargs: dict
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(input_ids, inputs_embeds, 2-D attention_mask)`` of one forward of ``chunk``."""
    named = dict(zip(_forward_params(chunk), args, strict=False))

    def get(name: str) -> torch.Tensor | None:
        value = kwargs.get(name, named.get(name))
        return value if isinstance(value, torch.Tensor) else None

    mask = get("attention_mask")
    return (
        get("input_ids"),
        get("inputs_embeds"),
        mask if mask is not None and mask.dim() == 2 else None,
    )


def real_token_mask(chunk: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``[batch * width]`` bool, True = real token, of one forward of ``chunk``; None when its
    forward has no 2-D ``attention_mask`` (every position real). A view, no host read."""
    ids, embeds, mask = _forward_inputs(chunk, args, kwargs)
    if mask is None:
        return None
    tokens = ids if ids is not None else embeds
    width = int(tokens.shape[1]) if tokens is not None and tokens.dim() >= 2 else mask.shape[1]
    return mask[:, mask.shape[1] - width :].reshape(-1).bool()


class ExpertLoadCollector:
    """Per-layer expert assignment counts of the training forwards of one step, on device."""

    def __init__(
        self,
        chunks: list[nn.Module],
        routers: list[tuple[str, nn.Module, RouterSpec]],
        *,
        num_layers: int | None = None,
        parents: dict[int, nn.Module | None] | None = None,
    ):
        """Use :meth:`attach`; this hooks the given routers and chunks.

        ``parents``: each router's parent module by ``id(router)`` (where some families keep
        the expert bias and the router beside the experts).
        """
        self._active_depth = 0  # > 0 inside a training forward of a chunk
        self.counting = True  # False: count nothing (PolicyMetrics: outside step())
        #: True: forwards that are not training forwards count as the rollout's (generation)
        self.rollout_counting = False
        self.rollout_seen = False  # a rollout forward was counted since the last reset
        #: Set for one generate call (PolicyMetrics.generation(eos_token_ids=...)): its
        #: forwards count no position after a sequence's end (moe.generation_mask)
        self.end_of_sequence: EndOfSequence | None = None
        self._entered: list[bool] = []
        self._masks: list[torch.Tensor | None] = []  # real-token mask per open chunk forward
        self._handles: list[Any] = []
        self._accs: list[LayerAccumulator] = []
        self._reducers: dict[Any, Any] = {}
        self.sequence_parallel = False
        self._num_layers = num_layers
        #: module-name prefix of each layer's MoE block (the matched module's parent, or the
        #: matched module itself when its spec hooks a submodule)
        self.blocks: dict[int, str] = {}
        # The metric families' per-forward subscriptions (moe.subscriptions), in order.
        self._observers: list[ForwardObserver] = []
        self._serial = 0  # training forwards counted since the last reset
        self._hooked: list[HookedRouter] = []
        parents = parents or {}
        self._bias_sources: list[tuple[int, Callable[[], torch.Tensor | None]]] = []
        seen: dict[int, str] = {}
        for name, module, spec in routers:
            layer = self._layer_of(name, module, spec)
            if layer in seen:
                raise ValueError(same_layer_message(seen[layer], name, layer))
            seen[layer] = name
            self.blocks[layer] = name if spec.hooked else name.rpartition(".")[0]
            experts, topk = spec.num_experts(module), spec.topk(module)
            if experts < 1 or topk < 1:
                raise ValueError(f"router {name!r}: num_experts={experts}, topk={topk}; need >= 1")
            hooked = spec.hooked(module) if spec.hooked else module
            param = next(module.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            acc = LayerAccumulator(layer, experts, topk, device, spec.zero_computation)
            self._accs.append(acc)
            parent = parents.get(id(module))
            self._hooked.append(HookedRouter(name, module, spec, layer, parent))
            if spec.expert_bias is not None:
                get = spec.expert_bias
                self._bias_sources.append((layer, lambda get=get, m=module, p=parent: get(m, p)))
            self._handles.append(
                hooked.register_forward_hook(self._router_hook(acc, spec, module), with_kwargs=True)
            )
            cfg = getattr(module, "config", None)
            self.sequence_parallel |= bool(getattr(cfg, "sequence_parallel", False))
        self._reads_mask = any(spec.padding_from_model for _, _, spec in routers)
        for chunk in chunks:
            self._handles.append(chunk.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(chunk.register_forward_hook(self._leave, always_call=True))
        self._accs.sort(key=lambda a: a.layer_id)
        self._constants = ConstantTensors()
        self._buffers = self._allocate()
        #: host memory every tracker of this collector keeps its forwards' tensors in
        self.staging = HostStaging(dedup=True)
        self._kept = KeptPicks(self.staging)
        self.staging.add_consumer(self._count_picks)
        #: some counted layer routes every token: then no step routes fewer than its real tokens
        self.routes_every_token = any(not spec.token_subset for _, _, spec in routers)

    def _layer_of(self, name: str, module: nn.Module, spec: RouterSpec) -> int:
        if spec.layer_id is not None:
            return spec.layer_id(module, name)
        mtp = mtp_index(name)
        if mtp is None:
            return layer_id_from_name(name)
        if self._num_layers is None:
            raise ValueError(
                f"router {name!r} sits in a multi-token-prediction layer; attach with "
                "num_layers=<decoder layers> so it is counted as layer num_layers + j"
            )
        return self._num_layers + mtp

    def _allocate(self) -> list[LayerBuffers]:
        """One pair of buffers per device the layers' routers live on (one, nearly always)."""
        by_device: dict[torch.device, list[LayerAccumulator]] = {}
        for acc in self._accs:
            by_device.setdefault(acc.device, []).append(acc)
        return [LayerBuffers(accs, device, self._constants) for device, accs in by_device.items()]

    def _move(self, acc: LayerAccumulator, device: torch.device) -> None:
        """A layer's router moved after attach (the model was moved): its accumulators follow,
        values kept."""
        self.count_kept()
        names = ("counts", "executed", "tokens", "zero_picks", "rollout")
        moved = [a for a in self._accs if a is acc or a.device == acc.device]
        kept = [[getattr(a, name).to(device) for name in names] for a in moved]
        for a in moved:
            a.device = device
        self._buffers = self._allocate()
        for a, values in zip(moved, kept, strict=True):
            for name, value in zip(names, values, strict=True):
                getattr(a, name).copy_(value)

    @classmethod
    def hook(
        cls,
        chunks: list[nn.Module],
        routers: list[tuple[str, nn.Module, RouterSpec]],
        parents: dict[int, nn.Module | None],
        *,
        num_layers: int | None = None,
    ) -> ExpertLoadCollector | None:
        """Hook the ``routers`` found in ``chunks`` (``adapters.registry.find_routers``: the
        collector knows no family); None, and no hooks at all, when there is none.

        Multi-token-prediction layers are counted as global layers ``num_layers + j`` (megatron
        numbers its MTP routers so itself; for models numbered by module name, pass
        ``num_layers``, the main decoder's layer count). ``attach_collector(model_chunks)``
        finds the routers and calls this.
        """
        if not routers:
            return None
        return cls(chunks, routers, num_layers=num_layers, parents=parents)

    def expert_bias_sources(self) -> list[tuple[int, Callable[[], torch.Tensor | None]]]:
        """``(global layer id, getter of the current bias buffer or None)`` per hooked router
        whose class knows where an aux-loss-free expert bias lives (``moe.expert_bias``)."""
        return list(self._bias_sources)

    # -- hooks (hot path: Python flags and device ops only) --------------------------------
    def _enter(self, chunk: nn.Module, args: tuple, kwargs: dict) -> None:
        training = chunk.training and torch.is_grad_enabled() and not in_backward()
        self._entered.append(training)
        if training:
            self._active_depth += 1
        if not self._reads_mask:
            self._masks.append(None)
        elif self.end_of_sequence is not None and self.rollout_counting and not training:
            ids, _, mask = _forward_inputs(chunk, args, kwargs)
            self._masks.append(self.end_of_sequence.real(ids, mask))
        else:
            self._masks.append(real_token_mask(chunk, args, kwargs))

    def _leave(self, chunk: nn.Module, args: tuple, output: Any) -> None:
        if self._entered and self._entered.pop():
            self._active_depth -= 1
        if self._masks:
            self._masks.pop()

    def subscribe(self, observer: ForwardObserver) -> None:
        """Call ``observer`` at every router forward, counted batch, reset and detach
        (``moe.subscriptions``), after the observers subscribed before it."""
        self._observers.append(observer)

    def unsubscribe(self, observer: ForwardObserver) -> None:
        """Stop calling ``observer`` (nothing is undone: see its ``detach``)."""
        self._observers.remove(observer)

    @property
    def routers(self) -> list[HookedRouter]:
        """Every hooked router: name, matched module, spec, global layer id, parent module."""
        return list(self._hooked)

    @property
    def device(self) -> torch.device:
        """Where the accumulators of the first layer live (the trackers' device)."""
        return self._accs[0].counts.device

    def _counts_now(self, module: nn.Module) -> bool:
        return self.counting and self._active_depth > 0 and module.training and not in_backward()

    def _router_hook(self, acc: LayerAccumulator, spec: RouterSpec, matched: nn.Module):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # No autograd graph: a measurement op on grad-requiring outputs (llama4's topk of
            # its logits) would save tensors for backward in the first forward only, since a
            # recomputation is not counted, and non-reentrant activation checkpointing refuses a
            # recomputation that saves fewer tensors than the forward did.
            with torch.no_grad():
                extra = {}
                valid = None
                if spec.padding_from_model:
                    valid = extra["valid"] = self._masks[-1] if self._masks else None
                kind = counts = executed = serial = None
                if self._counts_now(module):
                    kind, serial = TRAINING, self._serial
                    self._serial += 1
                    if spec.picks_fn is not None:  # kept, counted with the step's others
                        picks, kept_valid = spec.picks_fn(module, args, kwargs, output, **extra)
                        if picks.device != acc.device:  # the model moved after attach
                            self._move(acc, picks.device)
                        if self.staging.nbytes >= FLUSH_BYTES:  # count the kept ones first
                            self.staging.flush()
                        self._kept.keep(acc, picks, kept_valid, serial)
                    else:
                        counted = spec.counts_fn(module, args, kwargs, output, **extra)
                        counts = per_expert(counted[0])
                        if counts.device != acc.device:  # the model moved after attach
                            self._move(acc, counts.device)
                        acc.add(*counted)
                        executed = counted[2] if len(counted) > 2 else None
                elif self.rollout_counting and self._masks and not in_backward():
                    # A generation forward (prefill or decode): the rollout's load, real tokens.
                    kind = GENERATION
                    counts = per_expert(spec.counts_fn(module, args, kwargs, output, **extra)[0])
                    if counts.device != acc.device:
                        self._move(acc, counts.device)
                    acc.rollout.add_(counts)
                    self.rollout_seen = True
                if self._observers:  # every forward: a reader may drop what it captured
                    fields = (args, kwargs, output, valid, kind, counts, executed, serial)
                    seen = RouterForward(acc, matched, module, spec, *fields)
                    for observer in self._observers:
                        observer.forward(seen)

        return hook

    def observe_module(
        self, module: nn.Module, layer_id: int, observe: Callable[..., None]
    ) -> None:
        """Call ``observe(layer_id, module, output, valid)`` after each counted forward of
        ``module`` (``valid``: the model forward's real-token mask, None when every token is).

        For a module other than the one counted, such as a Hugging Face router whose logits feed
        the aux loss; same gating as the counts, and ``observe`` must only launch device ops.
        """

        def hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if self._counts_now(mod):
                with torch.no_grad():  # as the counts: no graph (activation checkpointing)
                    valid = self._masks[-1] if self._masks else None
                    observe(layer_id, mod, output, valid)

        self._handles.append(module.register_forward_hook(hook))

    # -- step boundary -----------------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        """Global 0-based layer index of each hooked router, ascending."""
        return [a.layer_id for a in self._accs]

    @property
    def num_experts(self) -> list[int]:
        """Experts per hooked layer, in ``layer_ids`` order."""
        return [a.num_experts for a in self._accs]

    @property
    def topks(self) -> list[int]:
        """Experts per token of each hooked layer, in ``layer_ids`` order."""
        return [a.topk for a in self._accs]

    @property
    def topk(self) -> int:
        """Experts per token, for callers that need one (routing consistency); an error when the
        layers differ."""
        ks = set(self.topks)
        if len(ks) != 1:
            raise ValueError(
                f"the MoE layers route to different numbers of experts per token {sorted(ks)}; "
                "routing consistency needs one top-k for the whole model"
            )
        return ks.pop()

    @property
    def zero_computation(self) -> list[bool]:
        """Per hooked layer: whether its router can pick zero-computation experts."""
        return [a.zero_computation for a in self._accs]

    def count_kept(self) -> None:
        """Count the kept picks into the accumulators (and hand them to the subscribers'
        ``counted``), after every tracker's pass over what the shared staging holds: device
        ops only, a few per batch of forwards."""
        self.staging.flush()

    def _count_picks(self) -> None:
        for batch in self._kept.take():
            routed, executed, tokens = forward_counts(batch, self._constants)
            device = batch.owners[0].device
            buffers = next(b for b in self._buffers if b.state.device == device)
            buffers.add_forwards(batch.owners, routed, executed, tokens)
            if self._observers:
                rows = [p.shape[0] for p in batch.picks]
                seen = CountedForwards(batch.owners, batch.serials, rows, routed, executed)
                for observer in self._observers:
                    observer.counted(seen)

    def local_counts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's device accumulators (per-layer routed counts [E] and tokens []), not
        copied."""
        self.count_kept()
        return [a.counts for a in self._accs], [a.tokens_now() for a in self._accs]

    def local_rollout(self) -> list[torch.Tensor]:
        """This rank's per-layer rollout (generation) counts [E], real tokens, not copied."""
        return [a.rollout for a in self._accs]

    def local_payload(self, device: torch.device) -> torch.Tensor:
        """This rank's accumulators as one int64 vector on ``device``: every layer's routed
        counts, then executed counts, routed tokens and zero-computation picks, in
        ``layer_ids`` order (``moe.reduction``'s layout). A view of the buffer itself, not a
        copy, when it is on ``device`` already."""
        self.count_kept()
        if len(self._buffers) == 1:
            return self._buffers[0].payload().to(device)
        for buffers in self._buffers:
            buffers.payload()
        parts = [
            *(a.counts for a in self._accs),
            *(a.executed for a in self._accs),
            *(a.tokens.reshape(1) for a in self._accs),
            *(a.zero_picks.reshape(1) for a in self._accs),
        ]
        return torch.cat([p.to(device) for p in parts])

    def reset_rollout(self) -> None:
        """Zero the rollout accumulators (after their export)."""
        for buffers in self._buffers:
            buffers.rollout.zero_()
        self.rollout_seen = False

    def reset(self) -> None:
        """Zero the device accumulators (start of a new step); the rollout's are kept."""
        self._kept.take()
        self.staging.reset()
        for buffers in self._buffers:
            buffers.reset()
        self._serial = 0
        for observer in self._observers:
            observer.reset()

    def export(self, group: Any = None, *, contribute: bool | None = None) -> ExpertLoads:
        """Reduce over ``group`` (default: world), reset, return loads identical on every rank.

        One host synchronisation; the first call per group also agrees on the layer signature.
        """
        if group not in self._reducers:
            self._reducers[group] = ExpertLoadReducer(group)
        return self._reducers[group].export(self, contribute=contribute)

    def detach(self) -> None:
        """Remove every hook this collector added."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for observer in self._observers:
            observer.detach()
