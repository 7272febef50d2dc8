"""The model families, which one a config or a module belongs to, and the router walk.

:data:`FAMILIES` lists one :class:`~nemo_moe_metrics.adapters.family.ModelFamily` per adapter
module; everything below loops over it. A module is a router when its class (or a class it
inherits from) was registered with :func:`register_router`, or a family's ``router_spec``
recognises it (megatron-core's and torchtitan's router classes by qualified name, so nothing is
imported to recognise them; transformers MoE modules by their interface). :func:`find_routers`
walks model chunks and returns what the collector (``moe.collector``) hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from nemo_moe_metrics.adapters import hf, megatron, torchtitan
from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.router_spec import CountsFn, RouterSpec

#: Every model family, asked in this order (megatron last: it takes any config with num_layers).
FAMILIES: tuple[ModelFamily, ...] = (torchtitan.FAMILY, hf.FAMILY, megatron.FAMILY)
_REGISTERED: dict[type, RouterSpec] = {}


def family_of(config: Any) -> ModelFamily:
    """The family whose config ``config`` is; TypeError naming what is accepted otherwise."""
    for family in FAMILIES:
        if family.owns_config(config):
            return family
    raise TypeError(
        f"PolicyMetrics.attach(model, config): config is a {type(config).__name__}; pass the "
        "model's megatron-core TransformerConfig or its transformers PretrainedConfig "
        "(model.config, or its config.json as a dict with model_type), or a torchtitan "
        "model config (e.g. DeepSeekV3Model.Config)"
    )


def model_facts(config: Any) -> ModelFacts:
    """What ``config`` says the metrics need: experts, layers, expert parallelism, top-k."""
    return family_of(config).facts(config)


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


def spec_for(module: nn.Module) -> RouterSpec | None:
    """The spec that reads ``module`` when it is a router of a known family, else None."""
    for cls in type(module).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls]
    for family in FAMILIES:
        spec = family.router_spec(module)
        if spec is not None:
            return spec
    return None


def find_routers(
    chunks: list[nn.Module],
) -> tuple[list[tuple[str, nn.Module, RouterSpec]], dict[int, nn.Module | None]]:
    """``(qualified name, module, spec)`` of every router in the chunks, and each one's parent.

    A matched module nested inside another (an experts module wrapping another experts module)
    is found once, at the outer one. Parents are keyed by ``id(module)``.
    """
    routers = []
    parents: dict[int, nn.Module | None] = {}
    for chunk in chunks:
        modules = dict(chunk.named_modules())
        matched: list[str] = []
        for name, module in modules.items():
            if any(name.startswith(outer + ".") for outer in matched):
                continue
            spec = spec_for(module)
            if spec is None:
                continue
            matched.append(name)
            routers.append((name, module, spec))
            parents[id(module)] = modules.get(name.rpartition(".")[0]) if name else None
    return routers, parents


def attach_collector(
    model_chunks: nn.Module | Iterable[nn.Module], *, num_layers: int | None = None
) -> ExpertLoadCollector | None:
    """Hook every MoE layer in the chunks; None (and no hooks at all) when there is none.

    Multi-token-prediction layers are counted as global layers ``num_layers + j`` (megatron
    numbers its MTP routers so itself; for models numbered by module name, pass ``num_layers``,
    the main decoder's layer count). A matched module nested inside another (an experts module
    wrapping another experts module) is counted once, at the outer one.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise TypeError("attach_collector() takes an nn.Module or a list of nn.Module chunks")
    routers, parents = find_routers(chunks)
    return ExpertLoadCollector.hook(chunks, routers, parents, num_layers=num_layers)


__all__ = [
    "FAMILIES",
    "attach_collector",
    "family_of",
    "find_routers",
    "model_facts",
    "register_router",
    "spec_for",
]
