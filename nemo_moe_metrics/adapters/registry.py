"""Which spec reads which router: the built-in families, registered classes, and the model walk.

A module is a router when its class (or a class it inherits from) was registered with
:func:`register_router`, is a built-in family's router class (megatron-core, torchtitan; by
qualified name, so nothing is imported to recognise them), or is a transformers MoE module
(``adapters.hf``). :func:`find_routers` walks model chunks and returns what the collector
(``moe.collector``) hooks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from nemo_moe_metrics.adapters import hf, megatron, torchtitan
from nemo_moe_metrics.moe.router_spec import CountsFn, RouterSpec

_BUILTIN: dict[str, RouterSpec] = {
    megatron.ROUTER_CLASS: megatron.SPEC,
    torchtitan.ROUTER_CLASS: torchtitan.SPEC,
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


def spec_for(module: nn.Module) -> RouterSpec | None:
    """The spec that reads ``module`` when it is a router of a known family, else None."""
    for cls in type(module).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls]
        spec = _BUILTIN.get(f"{cls.__module__}.{cls.__qualname__}")
        if spec is not None:
            return spec
    return hf.spec_for(module)


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
