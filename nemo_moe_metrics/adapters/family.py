"""The model-family contract: everything the package knows about one family, in one object.

Each adapter module (``adapters.megatron``, ``adapters.torchtitan``, ``adapters.hf``) defines one
:class:`ModelFamily` named ``FAMILY``; ``adapters.registry.FAMILIES`` lists them, and the router
lookup, the model facts, the FLOP estimate and ``PolicyMetrics.attach`` loop over that list. A
new family is one adapter module and one line there (docs/en/models.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # no torch at import: run.json and the CLI read ModelFacts without it
    from torch import nn

    from nemo_moe_metrics.flops.core import FlopsEstimator
    from nemo_moe_metrics.moe.router_spec import RouterSpec


@dataclass(frozen=True)
class ModelFacts:
    """What the worker needs to know about a model, read from its config."""

    num_experts: int  #: routed experts per MoE layer; 0 for a dense model
    num_layers: int  #: decoder layers (global layer ids index into them)
    ep_size: int  #: expert-parallel ranks (1 for Hugging Face models)
    aux_loss: Literal["megatron", "hf"] | None  #: where aux losses come from; None: none
    #: which family's config described the model (its ``ModelFamily.name``)
    source: str = "megatron"
    model_type: str | None = None  #: the Hugging Face model_type (None for megatron)
    expert_bias: bool = False  #: routers keep an aux-loss-free expert bias (moe/expert_bias.py)
    topk: int | None = None  #: experts each token is routed to (None: the config names none)


def _as_given(chunks: list[nn.Module], config: Any) -> Any:
    return config


@dataclass(frozen=True)
class ModelFamily:
    """One model family: how to recognise its config and routers, and how it behaves.

    Attributes:
        name: the family (``ModelFacts.source``).
        owns_config: whether a config describes a model of this family.
        facts: the :class:`ModelFacts` a config of this family says.
        router_spec: the :class:`RouterSpec` that reads a module, when it is one of this
            family's routers (None otherwise).
        flops: ``(config, vocab_size, model or None) -> FlopsEstimator``; raises
            ``UnknownModelTypeError`` when there is no estimate.
        as_built: ``(model chunks, config) -> config``: the config the model itself decides
            (megatron's hybrid pattern; a transformers model's own config), checked against it.
        whole_on_every_rank: every rank holds the whole model and routes its own tokens (Hugging
            Face, torchtitan): the modules found decide which layers are MoE, and each rank's
            generation is its own rollout load. False (megatron): the config decides, so a
            pipeline stage without MoE layers still joins every collective.
        moe_layers: ``config -> (MoE decoder layer ids, top-k)`` where the config says them
            (megatron); None: the routers found say them.
        aux_loss_sources: ``(chunks, blocks) -> (kind, [(layer, router, logits index, ids
            index or None), ...])`` of a loss the model's own training computes from its router
            logits (transformers' ``load_balancing_loss_func``); None: the family has none.
        bias_from_modules: no config flag says whether routers keep an aux-loss-free bias;
            the layers that hold one decide (transformers).
    """

    name: str
    owns_config: Callable[[Any], bool]
    facts: Callable[[Any], ModelFacts]
    router_spec: Callable[[nn.Module], RouterSpec | None]
    flops: Callable[[Any, int | None, nn.Module | None], FlopsEstimator]
    as_built: Callable[[list[nn.Module], Any], Any] = _as_given
    whole_on_every_rank: bool = True
    moe_layers: Callable[[Any], tuple[list[int], int]] | None = None
    aux_loss_sources: (
        Callable[[list[nn.Module], dict[int, str]], tuple[str | None, list]] | None
    ) = None
    bias_from_modules: bool = False


def router_by_class(specs: dict[str, RouterSpec]) -> Callable[[nn.Module], RouterSpec | None]:
    """A ``router_spec`` that knows router classes by qualified name (nothing imported)."""

    def spec(module: nn.Module) -> RouterSpec | None:
        for cls in type(module).__mro__:
            found = specs.get(f"{cls.__module__}.{cls.__qualname__}")
            if found is not None:
                return found
        return None

    return spec


__all__ = ["ModelFacts", "ModelFamily", "router_by_class"]
