"""Router forward hooks that count expert assignments on the device, without host syncs.

How counting works (details and limits: docs/en/expert_load.md):

- ``ExpertLoadCollector.attach(model_chunks)`` finds every known router (megatron-core
  ``TopKRouter``, torchtitan's ``TokenChoiceTopKRouter``, every Hugging Face experts module
  through transformers' shared experts interface (``moe.hf_models``), or a class given to
  :func:`register_router`) and adds one forward hook per MoE layer plus a pre/post hook pair on
  each model chunk. Multi-token-prediction layers count as layers ``num_layers + j``.
- The chunk hooks mark a *training forward*: the chunk is in ``train()`` mode, autograd is on at
  the chunk's entry and we are not inside a backward pass. Routers count only inside such a
  forward. This is what makes activation recomputation safe: megatron's ``full`` recompute runs
  the first forward with grad disabled inside a checkpoint function (still inside the chunk's
  training forward: counted) and replays it during backward (the chunk forward is over and
  autograd's graph task is active: not counted). Reference-model / rollout log-probs under
  ``torch.no_grad()`` or ``eval()`` are never counted.
- ``counting`` scopes it to a step: ``PolicyMetrics`` sets it on entering ``step()`` and clears
  it on leaving, so a training forward outside ``step()`` is not counted into any step. A
  collector used on its own counts whenever the rules above hold (``counting`` stays True).
- Counts accumulate as int64 per layer on the router's device; the hook path only launches
  device ops (no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or branching on values).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nemo_moe_metrics.moe.balance import ExpertLoads

# counts_fn(module, args, kwargs, output) -> (counts, tokens[, executed[, zero_picks]]):
#   counts: routed assignments of non-padding tokens, per-expert integer counts [E] or a boolean
#     assignment map [T, E] (summed over T);
#   tokens: tokens the router saw (non-padding), a 0-d integer tensor or a Python int;
#   executed (optional, same forms as counts, None = counts): what the dispatcher hands to the
#     experts, padding included; omitted when the router cannot see padding;
#   zero_picks (optional, 0-d): top-k picks of zero-computation experts (not in counts).
CountsFn = Callable[[nn.Module, tuple, dict, Any], tuple]


@dataclass(frozen=True)
class RouterSpec:
    """How to read one router class: counts, number of experts, top-k and global layer id."""

    counts_fn: CountsFn
    num_experts: Callable[[nn.Module], int]
    topk: Callable[[nn.Module], int]
    layer_id: Callable[[nn.Module, str], int] | None = None
    # expert_bias(router, parent) -> the layer's aux-loss-free bias buffer [E] or None (the
    # buffer is read again at every export, so a buffer replaced after attach is followed).
    expert_bias: Callable[[nn.Module, nn.Module | None], torch.Tensor | None] | None = None
    # routes_fn(module, args, kwargs, output) -> (own choice [T, E] bool, executed [T, E] bool,
    #   non-padding tokens [T] bool or None, replay active): for routing consistency.
    routes_fn: Callable[[nn.Module, tuple, dict, Any], tuple] | None = None
    sequence_major: bool = False  #: router token order [s, b] (megatron) or [b, s]
    #: the submodule whose forward the hook reads (default: the matched module itself); the
    #: count and route functions receive it, num_experts/topk/layer_id the matched module.
    hooked: Callable[[nn.Module], nn.Module] | None = None
    zero_computation: bool = False  #: counts_fn reports picks of zero-computation experts
    # health(router, parent) -> moe.router_scoring.HealthSource (the router's scoring and a
    #   reader of one forward's logits, bias and padding) or a string saying why its decisions
    #   cannot be judged; called once per router when track_router_health is on.
    health: Callable[[nn.Module, nn.Module | None], Any] | None = None
    #: the counted experts see only some of the layer's tokens by design (ernie4_5_vl_moe's
    #: text experts: image and video tokens go to its vision experts)
    token_subset: bool = False


def _megatron_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # TopKRouter.forward(input, padding_mask=None) -> (probs, routing_map [T, E] bool), the map
    # after capacity dropping. In the code (not the docstring) padding_mask is True = padding:
    # routing() masks with `routing_map & ~padding_mask` and counts `(~padding_mask).sum()`.
    # The returned map still routes padding rows, and MoELayer hands exactly this map to the
    # token dispatcher: its column sums are what the experts execute (padding included).
    routing_map = output[1]
    executed = routing_map.sum(dim=0)
    padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    if padding_mask is None:
        return executed, routing_map.shape[0], executed
    valid = ~padding_mask.reshape(-1).bool()
    return (routing_map & valid.unsqueeze(-1)).sum(dim=0), valid.sum(), executed


def _torchtitan_counts(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # TokenChoiceTopKRouter.forward(x_BLD, expert_bias_E) -> (topk_scores_BLK,
    # topk_expert_ids_BLK, scores_BLE): count the expert ids (after the bias and any group
    # limit), as MoE.forward does for its tokens_per_expert_E; no padding mask reaches it.
    ids = output[1]
    ids = ids.to_local() if hasattr(ids, "to_local") else ids  # DTensor under TP/SP
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(module.num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts, flat.numel() // ids.shape[-1]


def _health(family: str) -> Callable[[nn.Module, nn.Module | None], Any]:
    # Imported on use: router health (and megatron's compat) only when the flag is on.
    def health(router: nn.Module, parent: nn.Module | None) -> Any:
        from nemo_moe_metrics.moe import router_scoring

        return getattr(router_scoring, f"{family}_health")(router, parent)

    return health


def _megatron_layer_id(module: nn.Module, name: str) -> int:
    from nemo_moe_metrics.megatron.compat import router_tracker_index

    index = router_tracker_index(module)
    if index is None:
        raise ValueError(
            f"megatron router {name!r} has no layer_number; build it inside a TransformerLayer "
            "(MoELayer.set_layer_number) so its global layer index is known"
        )
    return index


def _megatron_routes(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # The routing map is what the dispatcher executes (replayed experts under router replay,
    # after capacity dropping); the router's own top-k comes from its scores through the
    # RouterReplay wrapper (megatron.compat.capture_router_choice) when replay is configured.
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.moe.routing import indices_to_map

    routing_map = output[1]
    own = compat.pop_router_choice(module)
    chosen = routing_map if own is None else indices_to_map(own, routing_map.shape[1])
    padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
    return chosen, routing_map, valid, compat.router_replay_active(module)


_MEGATRON = RouterSpec(
    counts_fn=_megatron_counts,
    num_experts=lambda m: int(m.config.num_moe_experts),
    topk=lambda m: int(m.topk),
    layer_id=_megatron_layer_id,
    # moe_router_enable_expert_bias: TopKRouter.expert_bias (None when off).
    expert_bias=lambda router, parent: getattr(router, "expert_bias", None),
    routes_fn=_megatron_routes,
    sequence_major=True,
    health=_health("megatron"),
)
_TORCHTITAN = RouterSpec(
    counts_fn=_torchtitan_counts,
    num_experts=lambda m: int(m.num_experts),
    topk=lambda m: int(m.top_k),
    # load_balance_coeff set: the parent MoE keeps expert_bias_E (None otherwise).
    expert_bias=lambda router, parent: getattr(parent, "expert_bias_E", None),
    health=_health("torchtitan"),
)

# Built-in routers by "module.Class" so nothing is imported to recognise them.
_BUILTIN: dict[str, RouterSpec] = {
    "megatron.core.transformer.moe.router.TopKRouter": _MEGATRON,
    "torchtitan.models.common.moe.TokenChoiceTopKRouter": _TORCHTITAN,
}
_REGISTERED: dict[type, RouterSpec] = {}


def register_router(
    router_cls: type,
    counts_fn: CountsFn,
    *,
    num_experts: Callable[[nn.Module], int] | None = None,
    topk: Callable[[nn.Module], int] | None = None,
    layer_id: Callable[[nn.Module, str], int] | None = None,
) -> None:
    """Count the routers of class ``router_cls`` (and subclasses) with ``counts_fn``.

    ``counts_fn(module, args, kwargs, output)`` returns ``(counts, tokens)``: per-expert integer
    counts ``[E]`` or a boolean assignment map ``[T, E]`` of the non-padding tokens, and the
    number of (non-padding) tokens routed, as a 0-d tensor or int. It may return a third item,
    ``executed`` (same forms): what the experts really process, padding included; without it
    executed counts equal ``counts``. It must not synchronise with the host. ``num_experts`` and
    ``topk`` default to the attributes ``num_experts`` and ``top_k``/``topk``; ``layer_id(module,
    qualified_name)`` defaults to the integer after ``layers.`` in the module's name.
    """
    if not isinstance(router_cls, type) or not callable(counts_fn):
        raise TypeError("register_router(router_cls, counts_fn): pass a class and a callable")
    _REGISTERED[router_cls] = RouterSpec(
        counts_fn=counts_fn,
        num_experts=num_experts or (lambda m: int(m.num_experts)),
        topk=topk or (lambda m: int(getattr(m, "top_k", getattr(m, "topk", 0)))),
        layer_id=layer_id,
    )


def _spec_for(module: nn.Module) -> RouterSpec | None:
    for cls in type(module).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls]
        spec = _BUILTIN.get(f"{cls.__module__}.{cls.__qualname__}")
        if spec is not None:
            return spec
    from nemo_moe_metrics.moe import hf_models

    return hf_models.spec_for(module)


# mtp_layers.j (torchtitan), mtp.layers.j (megatron): the j-th multi-token-prediction layer.
_MTP_RE = re.compile(r"(?:^|\.)mtp(?:_layers|\.layers)\.(\d+)(?:\.|$)")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")


def layer_id_from_name(name: str) -> int:
    """The decoder layer index in a module's qualified name (``model.layers.3.mlp`` -> 3)."""
    found = _LAYER_RE.findall(name)
    if not found:
        raise ValueError(
            f"cannot tell the layer index of router {name!r} from its name; pass "
            "layer_id=lambda module, name: ... to register_router"
        )
    return int(found[-1])


def _same_layer_message(first: str, second: str, layer: int) -> str:
    """Why two routers with one global layer id are refused, and what to do."""
    stacks = [_LAYER_RE.split(name)[0] for name in (first, second)]
    if stacks[0] != stacks[1]:  # two decoder stacks (diffusion_gemma's encoder and decoder)
        return (
            f"routers {first!r} and {second!r} both claim global layer {layer}: the model has "
            f"two MoE stacks ({stacks[0]!r}, {stacks[1]!r}) numbered from 0 each; attach only "
            "the stack you train (qwen3_omni_moe: model.thinker), or register the router class "
            "with a layer_id function that numbers the stacks apart (docs/en/models.md)"
        )
    return (
        f"routers {first!r} and {second!r} both claim global layer {layer}; "
        "pass each model chunk once, or give register_router a layer_id function"
    )


def _in_backward() -> bool:
    # Inside autograd's backward (where checkpointing replays forwards) the engine has a graph
    # task. Compiled graphs never replay Python hooks, and dynamo cannot trace this call.
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _per_expert(counts: torch.Tensor) -> torch.Tensor:
    if counts.dtype == torch.bool or counts.dim() == 2:
        counts = counts.sum(dim=0)
    return counts.to(torch.int64)


class _LayerAccumulator:
    """Device int64 routed counts [E], executed counts [E], routed tokens [] and picks of
    zero-computation experts [] of one MoE layer."""

    def __init__(
        self,
        layer_id: int,
        num_experts: int,
        topk: int,
        device: torch.device,
        zero_computation: bool = False,
    ):
        self.layer_id = layer_id
        self.num_experts = num_experts
        self.topk = topk
        self.zero_computation = zero_computation
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.executed = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.zero_picks = torch.zeros((), dtype=torch.int64, device=device)

    def add(
        self,
        counts: torch.Tensor,
        tokens: torch.Tensor | int,
        executed: torch.Tensor | None = None,
        zero_picks: torch.Tensor | None = None,
    ) -> None:
        counts = _per_expert(counts)
        if counts.device != self.counts.device:  # the model moved after attach
            for name in ("counts", "executed", "tokens", "zero_picks"):
                setattr(self, name, getattr(self, name).to(counts.device))
        self.counts.add_(counts)
        self.executed.add_(counts if executed is None else _per_expert(executed))
        self.tokens.add_(tokens)
        if zero_picks is not None:
            self.zero_picks.add_(zero_picks)


class ExpertLoadCollector:
    """Per-layer expert assignment counts of the training forwards of one step, on device."""

    def __init__(
        self,
        chunks: list[nn.Module],
        routers: list[tuple[str, nn.Module, RouterSpec]],
        *,
        num_layers: int | None = None,
    ):
        """Use :meth:`attach`; this hooks the given routers and chunks."""
        self._active_depth = 0  # > 0 inside a training forward of a chunk
        self.counting = True  # False: count nothing (PolicyMetrics: outside step())
        self._entered: list[bool] = []
        self._handles: list[Any] = []
        self._accs: list[_LayerAccumulator] = []
        self._reducers: dict[Any, Any] = {}
        self.sequence_parallel = False
        self.routing: Any = None  # moe.routing.RoutingTracker once enable_routing() ran
        self._compared: set[int] = set()  # the layers routing consistency compares
        self._routers = routers
        self._num_layers = num_layers
        #: module-name prefix of each layer's MoE block (the matched module's parent, or the
        #: matched module itself when its spec hooks a submodule)
        self.blocks: dict[int, str] = {}
        self.health: Any = None  # moe.router_health.RouterHealthTracker once enable_health() ran
        self._health_sources: dict[int, Any] = {}  # id(matched module) -> HealthSource
        self._parents: dict[int, nn.Module | None] = {}
        seen: dict[int, str] = {}
        for name, module, spec in routers:
            layer = self._layer_of(name, module, spec)
            if layer in seen:
                raise ValueError(_same_layer_message(seen[layer], name, layer))
            seen[layer] = name
            self.blocks[layer] = name if spec.hooked else name.rpartition(".")[0]
            experts, topk = spec.num_experts(module), spec.topk(module)
            if experts < 1 or topk < 1:
                raise ValueError(f"router {name!r}: num_experts={experts}, topk={topk}; need >= 1")
            hooked = spec.hooked(module) if spec.hooked else module
            param = next(module.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            acc = _LayerAccumulator(layer, experts, topk, device, spec.zero_computation)
            self._accs.append(acc)
            self._handles.append(
                hooked.register_forward_hook(self._router_hook(acc, spec, module), with_kwargs=True)
            )
            cfg = getattr(module, "config", None)
            self.sequence_parallel |= bool(getattr(cfg, "sequence_parallel", False))
        for chunk in chunks:
            self._handles.append(chunk.register_forward_pre_hook(self._enter))
            self._handles.append(chunk.register_forward_hook(self._leave, always_call=True))
        self._accs.sort(key=lambda a: a.layer_id)
        #: some counted layer routes every token: then no step routes fewer than its real tokens
        self.routes_every_token = any(not spec.token_subset for _, _, spec in routers)
        self._bias_sources: list[tuple[int, Callable[[], torch.Tensor | None]]] = []

    def _layer_of(self, name: str, module: nn.Module, spec: RouterSpec) -> int:
        if spec.layer_id is not None:
            return spec.layer_id(module, name)
        mtp = _MTP_RE.search(name)
        if mtp is None:
            return layer_id_from_name(name)
        if self._num_layers is None:
            raise ValueError(
                f"router {name!r} sits in a multi-token-prediction layer; attach with "
                "num_layers=<decoder layers> so it is counted as layer num_layers + j"
            )
        return self._num_layers + int(mtp.group(1))

    @classmethod
    def attach(
        cls, model_chunks: nn.Module | Iterable[nn.Module], *, num_layers: int | None = None
    ) -> ExpertLoadCollector | None:
        """Hook every MoE layer in the chunks; None (and no hooks at all) when there is none.

        Multi-token-prediction layers are counted as global layers ``num_layers + j`` (megatron
        numbers its MTP routers so itself; for models numbered by module name, pass
        ``num_layers``, the main decoder's layer count). A matched module nested inside another
        (an experts module wrapping another experts module) is counted once, at the outer one.
        """
        chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
            raise TypeError("attach() takes an nn.Module or a list of nn.Module model chunks")
        routers = []
        parents: dict[int, nn.Module | None] = {}
        for chunk in chunks:
            modules = dict(chunk.named_modules())
            matched: list[str] = []
            for name, module in modules.items():
                if any(name.startswith(outer + ".") for outer in matched):
                    continue
                spec = _spec_for(module)
                if spec is None:
                    continue
                matched.append(name)
                routers.append((name, module, spec))
                parents[id(module)] = modules.get(name.rpartition(".")[0]) if name else None
        if not routers:
            return None
        collector = cls(chunks, routers, num_layers=num_layers)
        collector._parents = parents
        for name, module, spec in routers:
            if spec.expert_bias is not None:
                layer = collector._layer_of(name, module, spec)
                get = spec.expert_bias
                parent = parents[id(module)]
                collector._bias_sources.append(
                    (layer, lambda get=get, m=module, p=parent: get(m, p))
                )
        return collector

    def expert_bias_sources(self) -> list[tuple[int, Callable[[], torch.Tensor | None]]]:
        """``(global layer id, getter of the current bias buffer or None)`` per hooked router
        whose class knows where an aux-loss-free expert bias lives (``moe.expert_bias``)."""
        return list(self._bias_sources)

    # -- hooks (hot path: Python flags and device ops only) --------------------------------
    def _enter(self, chunk: nn.Module, args: tuple) -> None:
        training = chunk.training and torch.is_grad_enabled() and not _in_backward()
        self._entered.append(training)
        if training:
            self._active_depth += 1

    def _leave(self, chunk: nn.Module, args: tuple, output: Any) -> None:
        if self._entered and self._entered.pop():
            self._active_depth -= 1

    def _counts_now(self, module: nn.Module) -> bool:
        return self.counting and self._active_depth > 0 and module.training and not _in_backward()

    def _router_hook(self, acc: _LayerAccumulator, spec: RouterSpec, matched: nn.Module):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            source = self._health_sources.get(id(matched)) if self.health is not None else None
            # Read on every forward: a captured logits tensor never outlives its forward.
            decision = source.read(args, kwargs, output) if source is not None else None
            if self._counts_now(module):
                counted = spec.counts_fn(module, args, kwargs, output)
                counts = _per_expert(counted[0])
                acc.add(counts, *counted[1:])
                if self.health is not None:
                    logits, bias, valid = decision if decision is not None else (None, None, None)
                    self.health.observe(acc.layer_id, counts, logits, bias=bias, valid=valid)
                if self.routing is not None and acc.layer_id in self._compared:
                    assert spec.routes_fn is not None
                    self.routing.observe(
                        acc.layer_id, *spec.routes_fn(module, args, kwargs, output)
                    )

        return hook

    def observe_module(
        self, module: nn.Module, layer_id: int, observe: Callable[[int, nn.Module, Any], None]
    ) -> None:
        """Call ``observe(layer_id, module, output)`` after each counted forward of ``module``.

        For a module other than the one counted, such as a Hugging Face router whose logits feed
        the aux loss; same gating as the counts, and ``observe`` must only launch device ops.
        """

        def hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if self._counts_now(mod):
                observe(layer_id, mod, output)

        self._handles.append(module.register_forward_hook(hook))

    def enable_routing(self, moe_layers: list[int], *, rollout_experts: int = 0) -> Any:
        """Compare rollout routes with these routers' choices (``moe.routing.RoutingTracker``).

        ``moe_layers``: every MoE layer of the model (global ids, model order), the layer axis
        of the rollout routes. Megatron routers with router replay configured also report their
        own top-k under replay (``megatron.compat.capture_router_choice``). ``rollout_experts``
        > 0 also counts the rollout's own expert load (``RoutingTracker``).
        """
        from nemo_moe_metrics.moe.routing import RoutingTracker

        specs = {spec for _, _, spec in self._routers}
        unsupported = [name for name, _, spec in self._routers if spec.routes_fn is None]
        if unsupported:
            raise ValueError(
                f"track_routing_consistency: routers {unsupported[:3]} were registered without a "
                "routes function; routing consistency supports megatron-core and Hugging Face "
                "routers"
            )
        # Rollout engines return routes for the decoder's MoE layers only: MTP layers (and any
        # other layer outside moe_layers) are counted but not compared.
        compared = [a for a in self._accs if a.layer_id in set(moe_layers)]
        topks = {a.topk for a in compared}
        if len(topks) > 1:
            raise ValueError(
                f"track_routing_consistency: the MoE layers route to different numbers of "
                f"experts per token {sorted(topks)}; rollout routes need one top-k"
            )
        for name, module, spec in self._routers:
            if spec is _MEGATRON and not _MTP_RE.search(name):
                from nemo_moe_metrics.megatron import compat

                compat.capture_router_choice(module)
        self._compared = {a.layer_id for a in compared}
        self.routing = RoutingTracker(
            [a.layer_id for a in compared],
            moe_layers,
            topks.pop(),
            [a.num_experts for a in compared],
            self._accs[0].counts.device,
            sequence_major=any(spec.sequence_major for spec in specs),
            rollout_experts=rollout_experts,
        )
        return self.routing

    def enable_health(self, near_tie_gap: float) -> Any:
        """Judge these routers' decisions from their own logits (``moe.router_health``).

        Routers whose class knows no health reader, or whose score function cannot be
        determined, get no router-health keys (one warning names them); every router still
        reports ``max_over_ideal_microbatch``.
        """
        from nemo_moe_metrics.moe.router_health import RouterHealthTracker

        scorings: dict[int, Any] = {acc.layer_id: None for acc in self._accs}
        skipped: list[str] = []
        for name, module, spec in self._routers:
            layer = self._layer_of(name, module, spec)
            try:
                found = (
                    spec.health(module, self._parents.get(id(module)))
                    if spec.health is not None
                    else "registered without a health reader"
                )
            except ValueError as err:  # a scoring the arithmetic cannot follow (RouterScoring)
                found = str(err)
            if isinstance(found, str):
                skipped.append(f"{name} ({found})")
                continue
            self._health_sources[id(module)] = found
            scorings[layer] = found.scoring
        if skipped:
            warnings.warn(
                "track_router_health: no moe/...router_* keys for the layers of "
                f"{len(skipped)} router(s): {'; '.join(skipped[:3])}"
                f"{' ...' if len(skipped) > 3 else ''}. Their max_over_ideal_microbatch is "
                "still logged.",
                RuntimeWarning,
                stacklevel=3,
            )
        self.health = RouterHealthTracker(
            scorings, near_tie_gap=near_tie_gap, device=self._accs[0].counts.device
        )
        return self.health

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

    def local_counts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's device accumulators (per-layer routed counts [E] and tokens []), not copied."""
        return [a.counts for a in self._accs], [a.tokens for a in self._accs]

    def local_executed(self) -> list[torch.Tensor]:
        """This rank's per-layer executed counts [E] (padding included), not copied."""
        return [a.executed for a in self._accs]

    def local_zero_picks(self) -> list[torch.Tensor]:
        """This rank's per-layer picks of zero-computation experts [], not copied."""
        return [a.zero_picks for a in self._accs]

    def reset(self) -> None:
        """Zero the device accumulators (start of a new step)."""
        for a in self._accs:
            a.counts.zero_()
            a.executed.zero_()
            a.tokens.zero_()
            a.zero_picks.zero_()
        if self.routing is not None:
            self.routing.reset()
        if self.health is not None:
            self.health.reset()

    def export(self, group: Any = None, *, contribute: bool | None = None) -> ExpertLoads:
        """Reduce over ``group`` (default: world), reset, return loads identical on every rank.

        One host synchronisation; the first call per group also agrees on the layer signature.
        """
        from nemo_moe_metrics.moe.reduction import ExpertLoadReducer

        if group not in self._reducers:
            self._reducers[group] = ExpertLoadReducer(group)
        return self._reducers[group].export(self, contribute=contribute)

    def detach(self) -> None:
        """Remove every hook this collector added."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for source in self._health_sources.values():
            if source.release is not None:
                source.release()
        self._health_sources.clear()
