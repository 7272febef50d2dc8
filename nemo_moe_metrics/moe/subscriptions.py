"""What a metric family subscribed to the collector sees of each router forward.

The collector (``moe.collector``) counts expert assignments and knows no metric family. A family
that needs more of a router forward than its counts (router health reads the router's logits,
routing consistency its top-k, the overload factor its executed tokens per EP rank) subscribes
a :class:`ForwardObserver` with ``collector.subscribe(observer)``; the collector then calls:

- :meth:`ForwardObserver.forward` once per forward of every hooked router, with a
  :class:`RouterForward`: the layer, the matched module, the router's inputs and output, the
  real-token mask, and ``kind``: ``"training"`` (counted into the step), ``"generation"``
  (counted into the rollout's load) or None (not counted: eval, no-grad, a recomputation in
  backward, outside ``step()``);
- :meth:`ForwardObserver.counted` when the kept picks of training forwards are counted
  together (``moe.layer_counts``): their routed and executed counts, named by the forwards'
  ``serial``;
- :meth:`ForwardObserver.reset` when the collector zeroes its accumulators (a discarded or
  exported step), :meth:`ForwardObserver.detach` when it removes its hooks.

Observers run inside the router's forward hook under ``torch.no_grad()``: they only launch
device ops (no ``.item()``, ``.cpu()``, ``.tolist()`` or branching on tensor values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from nemo_moe_metrics.moe.layer_counts import LayerAccumulator
from nemo_moe_metrics.moe.router_spec import RouterSpec

#: A forward counted into the step's training counts.
TRAINING = "training"
#: A forward of a generation (``PolicyMetrics.generation()``), counted into the rollout's load.
GENERATION = "generation"

ForwardKind = Literal["training", "generation"]


@dataclass(frozen=True)
class HookedRouter:
    """One router the collector hooked: its name, module, spec, global layer and parent."""

    name: str
    module: nn.Module  #: the matched module (num_experts, top-k and health read it)
    spec: RouterSpec
    layer_id: int
    parent: nn.Module | None  #: where some families keep the expert bias beside the router


class RouterForward:
    """One forward of a hooked router, as :meth:`ForwardObserver.forward` sees it."""

    __slots__ = (
        "layer",
        "matched",
        "module",
        "spec",
        "args",
        "kwargs",
        "output",
        "valid",
        "kind",
        "counts",
        "executed",
        "serial",
    )

    def __init__(
        self,
        layer: LayerAccumulator,
        matched: nn.Module,
        module: nn.Module,
        spec: RouterSpec,
        args: tuple,
        kwargs: dict,
        output: Any,
        valid: torch.Tensor | None,
        kind: ForwardKind | None,
        counts: torch.Tensor | None,
        executed: Any,
        serial: int | None,
    ) -> None:
        """Built by the collector; see the attributes."""
        self.layer = layer  #: the layer's accumulator (``layer_id``, ``num_experts``, ``topk``)
        self.matched = matched  #: the module the router spec matched
        self.module = module  #: the module whose forward was hooked (the spec's ``hooked``)
        self.spec = spec
        self.args, self.kwargs, self.output = args, kwargs, output
        #: the model forward's real-token mask ``[T]`` bool for a router that sees no padding
        #: (``spec.padding_from_model``); None otherwise or when every token is real
        self.valid = valid
        self.kind = kind  #: "training", "generation" or None (not counted)
        #: this forward's routed counts ``[E]`` int64 when it was counted at once (training or
        #: generation); None for training picks kept and counted later (``counted``)
        self.counts = counts
        #: the executed counts ``counts_fn`` gave (``[E]`` or a ``[T, E]`` map), None: routed
        self.executed = executed
        #: the training forward's number since the collector's last reset (None otherwise)
        self.serial = serial

    @property
    def layer_id(self) -> int:
        """The global layer id of the router."""
        return self.layer.layer_id

    def apply(self, fn: Callable[..., Any]) -> Any:
        """``fn(module, args, kwargs, output[, valid=...])``, called as the collector calls the
        spec's functions (``routes_fn``, ``counts_fn``): ``valid`` only for a router that sees
        no padding."""
        if self.spec.padding_from_model:
            return fn(self.module, self.args, self.kwargs, self.output, valid=self.valid)
        return fn(self.module, self.args, self.kwargs, self.output)


@dataclass
class CountedForwards:
    """Kept training forwards counted together (``moe.layer_counts``), as
    :meth:`ForwardObserver.counted` sees them; one entry per forward in each list."""

    owners: list[LayerAccumulator]  #: each forward's layer
    serials: list[int]  #: each forward's ``RouterForward.serial``
    rows: list[int]  #: each forward's token rows (padding included)
    routed: torch.Tensor  #: ``[F, E]`` int64 routed counts of the real rows
    executed: torch.Tensor | None  #: ``[F, E]`` int64 counts of every row; None: ``routed``

    @property
    def layer_ids(self) -> list[int]:
        """Each forward's global layer id."""
        return [acc.layer_id for acc in self.owners]


class ForwardObserver:
    """A per-forward subscription to the collector; every method is a no-op unless overridden."""

    def forward(self, fwd: RouterForward) -> None:
        """One forward of a hooked router (every forward: read ``fwd.kind``)."""

    def counted(self, forwards: CountedForwards) -> None:
        """Kept training forwards were counted together."""

    def reset(self) -> None:
        """The collector zeroed its accumulators: forget the step."""

    def detach(self) -> None:
        """The collector removed its hooks: undo what the subscription hooked."""


__all__ = [
    "GENERATION",
    "TRAINING",
    "CountedForwards",
    "ForwardKind",
    "ForwardObserver",
    "HookedRouter",
    "RouterForward",
]
