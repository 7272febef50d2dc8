"""megatron-core's ``TopKRouter``: counts, routes, layer id, expert bias and health.

The whole router contract (:class:`~nemo_moe_metrics.moe.router_spec.RouterSpec`) for one
family. Version differences of megatron-core stay in ``megatron.compat``; nothing here imports
megatron-core itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from nemo_moe_metrics.adapters.family import ModelFacts, ModelFamily, router_by_class
from nemo_moe_metrics.flops.megatron import is_megatron_config
from nemo_moe_metrics.flops.registry import get_flops_estimator
from nemo_moe_metrics.megatron import compat
from nemo_moe_metrics.megatron.layout import config_as_built
from nemo_moe_metrics.moe.aux_loss import moe_layer_indices
from nemo_moe_metrics.moe.router_health import SCORE_FUNCTIONS, RouterScoring
from nemo_moe_metrics.moe.router_spec import HealthSource, RouterSpec
from nemo_moe_metrics.moe.routing import indices_to_map


def _padding_valid(args: tuple, kwargs: dict) -> Any:
    # TopKRouter.forward(input, padding_mask=None). In the code (not the docstring) padding_mask
    # is True = padding: routing() masks with `routing_map & ~padding_mask`.
    padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    return None if padding_mask is None else ~padding_mask.reshape(-1).bool()


def _counts(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # TopKRouter.forward -> (probs, routing_map [T, E] bool), the map after capacity dropping.
    # The returned map still routes padding rows, and MoELayer hands exactly this map to the
    # token dispatcher: its column sums are what the experts execute (padding included).
    routing_map = output[1]
    executed = routing_map.sum(dim=0)
    valid = _padding_valid(args, kwargs)
    if valid is None:
        return executed, routing_map.shape[0], executed
    return (routing_map & valid.unsqueeze(-1)).sum(dim=0), valid.sum(), executed


def _picks(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # The map itself (what _counts sums), kept and counted with the step's other forwards.
    return output[1], _padding_valid(args, kwargs)


def _layer_id(module: nn.Module, name: str) -> int:
    index = compat.router_tracker_index(module)
    if index is None:
        raise ValueError(
            f"megatron router {name!r} has no layer_number; build it inside a TransformerLayer "
            "(MoELayer.set_layer_number) so its global layer index is known"
        )
    return index


def _routes(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    # The routing map is what the dispatcher executes (replayed experts under router replay,
    # after capacity dropping); the router's own top-k comes from its scores through the
    # RouterReplay wrapper (compat.capture_router_choice) when replay is configured.
    routing_map = output[1]
    own = compat.pop_router_choice(module)
    chosen = routing_map if own is None else indices_to_map(own, routing_map.shape[1])
    return chosen, routing_map, _padding_valid(args, kwargs), compat.router_replay_active(module)


def health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """Score function, pre-softmax and groups from the router's config; logits from its gating."""
    cfg = router.config
    routing = getattr(router, "routing_type", cfg.moe_router_load_balancing_type)
    if routing in ("sinkhorn", "quantile_balancing"):
        return f"{routing} routing has no top-k of scores to judge"
    if getattr(cfg, "moe_router_force_load_balancing", False):
        return "moe_router_force_load_balancing routes random logits"
    if getattr(cfg, "moe_router_force_biased", None) is not None:
        return "moe_router_force_biased routes biased random logits"
    score = getattr(router, "score_function", getattr(cfg, "moe_router_score_function", None))
    if score not in SCORE_FUNCTIONS:
        return f"score function {score!r} is not one of {SCORE_FUNCTIONS}"
    topk = int(router.topk)
    group_topk = getattr(cfg, "moe_router_group_topk", None)
    scoring = RouterScoring(
        score_function=score,
        num_experts=int(cfg.num_moe_experts),
        topk=topk,
        rank_on_logits=score == "softmax" and not getattr(cfg, "moe_router_pre_softmax", False),
        num_groups=getattr(cfg, "moe_router_num_groups", None),
        group_topk=group_topk,
        group_score_topk=topk // group_topk if group_topk else 2,
    )
    compat.capture_router_logits(router)
    # megatron-core adds expert_bias to sigmoid / sqrt-softplus scores only; its softmax path
    # routes without it even when the buffer exists.
    biased = score != "softmax"

    def read(args: tuple, kwargs: dict, output: Any):
        bias = getattr(router, "expert_bias", None) if biased else None
        return compat.pop_router_logits(router), bias, _padding_valid(args, kwargs)

    # The routing map is the top-k of exactly the scores judged (padding rows included),
    # unless capacity dropping removed picks or replay chose; group-limited routing is judged
    # on group-masked scores, which the map alone does not give.
    exact_map = getattr(cfg, "moe_expert_capacity_factor", None) is None and not scoring.grouped

    def chosen(args: tuple, kwargs: dict, output: Any):
        return None if compat.router_replay_active(router) else output[1]

    return HealthSource(
        scoring,
        read,
        lambda: compat.release_router_logits(router),
        chosen=chosen if exact_map else None,
    )


SPEC = RouterSpec(
    counts_fn=_counts,
    picks_fn=_picks,
    num_experts=lambda m: int(m.config.num_moe_experts),
    topk=lambda m: int(m.topk),
    layer_id=_layer_id,
    # moe_router_enable_expert_bias: TopKRouter.expert_bias (None when off).
    expert_bias=lambda router, parent: getattr(router, "expert_bias", None),
    routes_fn=_routes,
    capture_choice=compat.capture_router_choice,
    sequence_major=True,
    health=health,
)
#: the router class this spec reads, by qualified name (nothing is imported to recognise it)
ROUTER_CLASS = "megatron.core.transformer.moe.router.TopKRouter"


def owns_config(config: Any) -> bool:
    """A megatron-core ``TransformerConfig``, or any config with ``num_layers`` (the family
    asked last: transformers and torchtitan configs are recognised first)."""
    return hasattr(config, "num_layers")


def megatron_facts(config: Any) -> ModelFacts:
    """Experts, layers, expert parallelism, top-k and expert bias of a ``TransformerConfig``."""
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    bias = bool(experts and getattr(config, "moe_router_enable_expert_bias", False))
    topk = int(getattr(config, "moe_router_topk", 0) or 0) or None
    aux = "megatron" if experts else None
    return ModelFacts(
        experts, int(config.num_layers), ep, aux, "megatron", expert_bias=bias, topk=topk
    )


def _as_built(chunks: list[nn.Module], config: Any) -> Any:
    # The model decides: a hybrid model's pattern and the layers that hold routers.
    return config_as_built(chunks, config) if is_megatron_config(config) else config


def _moe_layers(config: Any) -> tuple[list[int], int]:
    # Decoder MoE layers only: engines return routes for the decoder's routers.
    layers = [i for i in moe_layer_indices(config) if i < int(config.num_layers)]
    return layers, int(config.moe_router_topk)


FAMILY = ModelFamily(
    name="megatron",
    owns_config=owns_config,
    facts=megatron_facts,
    router_spec=router_by_class({ROUTER_CLASS: SPEC}),
    flops=lambda config, vocab_size, model: get_flops_estimator(config, vocab_size=vocab_size),
    as_built=_as_built,
    whole_on_every_rank=False,
    moe_layers=_moe_layers,
)
