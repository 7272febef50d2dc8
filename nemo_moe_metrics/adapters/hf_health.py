"""How transformers routers decide, and the readers router health uses for them.

:data:`HF_ROUTING` describes each family's routing (score function, groups, bias, where the
logits are); the readers (:func:`hf_health`, :func:`hf_experts_health`, :func:`doge_health`),
named by the specs of ``adapters.hf``, are called once per router when ``track_router_health``
is on. Each returns a :class:`~nemo_moe_metrics.moe.router_spec.HealthSource` (the router's
static :class:`~nemo_moe_metrics.moe.router_health.RouterScoring` and a reader of one forward's
logits and expert bias) or a string saying why this router's decisions cannot be judged; such
a router gets no router-health keys (and one warning), never made-up numbers.

The logits are the ones the router computes itself: the first item of its output ``(logits,
weights, indices)``, or where the family keeps them (:data:`HF_ROUTING`; doge builds them from
its product keys), captured by a hook on the router beside the experts module, so health adds
no second gating matmul. (megatron-core and torchtitan routers: ``adapters.megatron``,
``adapters.torchtitan``.)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_moe_metrics.flops.hf_fields import (
    config_topk,
    experts_num,
    hf_model_type,
    routing_args,
)
from nemo_moe_metrics.moe.router_health import SCORE_FUNCTIONS, RouterScoring
from nemo_moe_metrics.moe.router_spec import HealthSource, in_backward, logits_of


@dataclass(frozen=True)
class HFRouting:
    """What a transformers family's router code fixes beyond what its module's attributes say.

    Read from each family's router forward (transformers 5.25) and checked for every family by
    ``tests/adapters/test_hf_health.py``: the top-k the resulting scoring describes is the
    indices the router returns, and its weights follow the score function.

    ``score_function``: None where the router names it itself (``scoring_func``-like attribute
    or a ``score_fn`` activation module). ``rank_on_logits`` / ``bias_on_logits``: the router
    takes the top-k of ``z`` (``z + bias``), not of its scores (:class:`RouterScoring`).
    ``group_score_topk`` / ``group_masked_score``: how its group limit scores a group and the
    experts outside the kept groups (the groups themselves come from ``n_group`` /
    ``num_group`` and ``topk_group``). ``classes``: the router attribute counting the classes
    it ranks, where zero-computation experts are among them (otherwise: the experts module's
    experts). ``logits_at``: where ``z`` is in the router's output; ``logits_module``: a child
    whose output is ``z``, for a router that returns probabilities instead.
    """

    score_function: str | None = None
    rank_on_logits: bool = False
    bias_on_logits: bool = False
    group_score_topk: int = 2
    group_masked_score: float = float("-inf")
    classes: str | None = None
    logits_at: int = 0
    logits_module: str | None = None


_SOFTMAX = HFRouting("softmax")
_SOFTMAX_OF_LOGITS = HFRouting("softmax", rank_on_logits=True)
_SIGMOID = HFRouting("sigmoid")

#: transformers modeling modules (``transformers.models.<name>``) -> how their routers decide.
#: Families whose router names its score function (deepseek_v4, inkling2, inkling2_loop:
#: ``score_fn = ACT2FN[config.scoring_func]``) need no entry.
HF_ROUTING: dict[str, HFRouting] = {
    # top-k of softmax(z)
    **dict.fromkeys(
        (
            "dbrx",
            "flex_olmo",
            "hunyuan_v1_moe",
            "jamba",
            "lara_mini",
            "mellum",
            "minimax",
            "mixtral",
            "olmoe",
            "qwen2_moe",
            "qwen3_5_moe",
            "qwen3_moe",
            "qwen3_next",
            "qwen3_omni_moe",
            "qwen3_vl_moe",
            "qwen4_exp",
        ),
        _SOFTMAX,
    ),
    # + moe_statics.e_score_correction_bias (the VL model: its text and vision routers alike)
    **dict.fromkeys(("ernie4_5_moe", "ernie4_5_vl_moe"), _SOFTMAX),
    # top-k of z, weights softmax over the chosen logits (the renormalised softmax)
    **dict.fromkeys(
        ("aria", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
        _SOFTMAX_OF_LOGITS,
    ),
    "jetmoe": HFRouting("softmax", rank_on_logits=True, logits_at=4),
    "doge": _SOFTMAX_OF_LOGITS,  # z of its product keys (doge_health)
    "cohere2_moe": HFRouting(rank_on_logits=True),  # expert_selection_fn: softmax or sigmoid
    # top-k of sigmoid(z) (+ an expert bias; DeepSeek-V3 groups where n_group is set)
    **dict.fromkeys(
        (
            "afmoe",
            "axk1",
            "bailing_hybrid",
            "beam",
            "deepseek_v3",
            "deepseek_v32",
            "dots1",
            "dots3_note",
            "ergo",
            "exaone_moe",
            "flint",
            "glm4_moe",
            "glm4_moe_lite",
            "glm4v_moe",
            "glm5_next",
            "glm_moe_dsa",
            "hy_v3",
            "hy_v4",
            "hy_v4_vl",
            "inkling",
            "kimi_linear",
            "laguna",
            "lfm2_moe",
            "mimo_v2_flash",
            "minicpm5_moe",
            "minimax_m2",
            "minimax_m3_vl",
            "muse_spark",
            "nemotron_h",
            "solar_open",
            "step3p7",
        ),
        _SIGMOID,
    ),
    "llama4": HFRouting("sigmoid", rank_on_logits=True, logits_at=1),
    # top-k of z + e_score_correction_bias; weights sigmoid of the chosen logits
    **dict.fromkeys(
        ("kolibri1", "kolibri1_1"), HFRouting("sigmoid", rank_on_logits=True, bias_on_logits=True)
    ),
    # group score: the best expert; experts of the other groups score 0, not -inf
    **dict.fromkeys(
        ("deepseek_v2", "deepseek_ocr2", "unlimited_ocr"),
        HFRouting("softmax", group_score_topk=1, group_masked_score=0.0),
    ),
    # softmax scores, a group scored by its best two; experts of the other groups score 0
    **dict.fromkeys(("mistral4", "mistral_large4"), HFRouting("softmax", group_masked_score=0.0)),
    "axk2": HFRouting("sigmoid", group_masked_score=0.0),
    # its first output is softmax(z); z is its proj's output
    "gemma4": HFRouting("softmax", logits_module="proj"),
    # zero-computation experts are classes of the router: n_routed_experts = experts + zeros
    "longcat_flash": HFRouting("softmax", classes="n_routed_experts"),
    "zaya": HFRouting("softmax", classes="num_router_classes"),  # experts + the skip class
}
#: Families whose routing is not a top-k of scores, with the reason (no router_* keys for them).
HF_UNJUDGED: dict[str, str] = {
    "phimoe": (
        "sparsemixer routing samples its experts (Gumbel noise) in training, after masking "
        "scores by a threshold: no top-k of scores to judge"
    ),
}
_SCORE_ATTRIBUTES = ("score_function", "score_func", "scoring_func", "expert_selection_fn")
#: activation modules a router keeps as its score function (``score_fn``), by class name
_SCORE_MODULES = {"Sigmoid": "sigmoid", "SqrtSoftplusActivation": "sqrtsoftplus"}
#: tensors holding an expert bias the router adds to its selection scores
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")


def hf_routing(router: nn.Module) -> HFRouting | str:
    """How a transformers router decides, or why it cannot be judged.

    The score function from the router itself where it names one (an attribute
    ``score_function`` / ``score_func`` / ``scoring_func`` / ``expert_selection_fn``, or a
    ``score_fn`` sigmoid / sqrt-softplus module), else from :data:`HF_ROUTING`.
    """
    family = hf_model_type(router) or ""
    if family in HF_UNJUDGED:
        return HF_UNJUDGED[family]
    if getattr(router, "tid2eid", None) is not None:
        return "hash routing: a fixed token-id -> experts table (tid2eid) chooses, not scores"
    routing = HF_ROUTING.get(family, HFRouting())
    named = next(
        (v for v in (getattr(router, a, None) for a in _SCORE_ATTRIBUTES) if isinstance(v, str)),
        None,
    )
    if named is None and isinstance(getattr(router, "score_fn", None), nn.Module):
        kind = type(router.score_fn).__name__
        named = _SCORE_MODULES.get(kind, kind)
    score = named or routing.score_function
    if score not in SCORE_FUNCTIONS:
        kind = family or type(router).__name__
        return (
            f"the score function of {kind} routers is not known ({score!r}; known: "
            f"{', '.join(SCORE_FUNCTIONS)})"
            if score
            else f"the routing of {kind} routers is not described (adapters/hf_health.py "
            "HF_ROUTING lists the families whose router code was read)"
        )
    return dataclasses.replace(routing, score_function=score)


def softmax_topk_ids_at(router: nn.Module, logits_at: int) -> int | None:
    """Where ``router``'s output ``(logits, weights, ids)`` holds the expert ids it chose, when
    they are the top-k of ``softmax(logits)`` (what transformers' ``load_balancing_loss_func``
    recomputes from the same logits): a router of :data:`HF_ROUTING` that ranks its softmax,
    without groups or an expert bias; else None."""
    routing = hf_routing(router)
    if routing != _SOFTMAX or logits_at != 0:
        return None
    if getattr(router, "n_group", None) or getattr(router, "num_group", None):
        return None
    if _bias_argument(router) is not None or _bias_reader(router)((), {}) is not None:
        return None
    return 2


def _hf_scoring(router: nn.Module, routing: HFRouting, experts: int, topk: int) -> RouterScoring:
    groups = getattr(router, "n_group", getattr(router, "num_group", None))
    if getattr(router, "topk_method", None) == "greedy":  # DeepSeek-V2: groups configured, unused
        groups = None
    group_topk = getattr(router, "topk_group", None)
    classes = getattr(router, routing.classes, None) if routing.classes else experts
    if classes is None:
        raise ValueError(f"{type(router).__name__} has no {routing.classes} (the classes it ranks)")
    assert routing.score_function is not None
    return RouterScoring(
        score_function=routing.score_function,
        num_experts=int(classes),
        topk=int(topk),
        rank_on_logits=routing.rank_on_logits,
        num_groups=int(groups) if groups else None,
        group_topk=int(group_topk) if groups and group_topk else None,
        group_score_topk=routing.group_score_topk,
        bias_on_logits=routing.bias_on_logits,
        group_masked_score=routing.group_masked_score,
    )


def _bias_argument(router: nn.Module) -> tuple[int, str] | None:
    """``(position, name)`` of the router's forward argument named ``...bias...``, or None."""
    try:
        params = list(inspect.signature(type(router).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    return next(((i, name) for i, name in enumerate(params) if "bias" in name), None)


def _bias_reader(router: nn.Module) -> Callable[[tuple, dict], torch.Tensor | None]:
    """Where the router's expert bias is: an argument of its forward named ``...bias...``
    (the MoE block passes its own buffer), else a tensor of the router named like one."""
    argument = _bias_argument(router)
    if argument is not None:
        position, name = argument
        return lambda args, kwargs: args[position] if len(args) > position else kwargs.get(name)
    tensors = dict(router.named_buffers()) | dict(router.named_parameters())
    found = next((n for n in tensors if n.rpartition(".")[2] in _BIAS_NAMES), None)
    if found is None:
        return lambda args, kwargs: None
    owner, _, attr = found.rpartition(".")
    module = router.get_submodule(owner)
    return lambda args, kwargs: getattr(module, attr)  # read at each forward: it can be replaced


def hf_health(router: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """A transformers router hooked itself: ``z`` is in its own output (:class:`HFRouting`).

    Its ``num_experts`` and ``top_k`` size the scoring. The expert bias is the argument of its
    forward named like one, or its ``e_score_correction_bias`` / ``expert_bias`` /
    ``balancing_biases`` tensor; the group limit its ``n_group`` (or ``num_group``) with
    ``topk_group``.
    """
    routing = hf_routing(router)
    if isinstance(routing, str):
        return routing
    topk = int(getattr(router, "top_k", getattr(router, "topk", 0)))
    scoring = _hf_scoring(router, routing, int(router.num_experts), topk)
    bias_of = _bias_reader(router)

    def read(args: tuple, kwargs: dict, output: Any):
        return logits_of(output, routing.logits_at), bias_of(args, kwargs), None

    return HealthSource(scoring, read)


def _router_beside(experts: nn.Module, block: nn.Module | None) -> nn.Module | None:
    # The block's child that routes: `gate` or `router`, or a class named `...Router`.
    candidates = [
        child
        for name, child in (block.named_children() if block is not None else ())
        if child is not experts and (name in ("gate", "router") or "Router" in type(child).__name__)
    ]
    return candidates[0] if len(candidates) == 1 else None


def hf_expert_bias(experts: nn.Module, block: nn.Module | None) -> torch.Tensor | None:
    """The aux-loss-free expert bias of an experts module's layer, as the model holds it now.

    A tensor named like one (:data:`_BIAS_NAMES`) of the router beside the experts (ernie4_5_moe
    keeps it in the router's ``moe_statics``), else of the MoE block itself, which passes it to
    the router's forward (minimax_m2, afmoe, hy_v3, lfm2_moe with ``use_expert_bias``); None
    when the layer has none. Looked up at each call: a buffer replaced after attach is read.
    """
    router = _router_beside(experts, block)
    for owner, recurse in ((router, True), (block, False)):
        if owner is None:
            continue
        tensors = dict(owner.named_buffers(recurse=recurse))
        tensors |= dict(owner.named_parameters(recurse=recurse))
        found = next((t for n, t in tensors.items() if n.rpartition(".")[2] in _BIAS_NAMES), None)
        if found is not None:
            return found.reshape(-1)  # ernie4_5_moe keeps it [1, E]: one value per expert
    return None


def hf_experts_health(experts: nn.Module, block: nn.Module | None) -> HealthSource | str:
    """A transformers experts module (``adapters.hf``): the router beside it in its MoE block.

    The router is the block's child that returns ``(logits, weights, indices)`` (``gate`` or
    ``router``, or a class named ``...Router``); its logits and the bias it was called with are
    captured by a forward hook on it and read when the experts run, in the same forward.
    """
    router = _router_beside(experts, block)
    if router is None:
        return f"no single router next to {type(experts).__qualname__} in its MoE block"
    routing = hf_routing(router)
    if isinstance(routing, str):
        return routing
    count = experts_num(experts)
    topk = getattr(router, "top_k", None) or getattr(block, "top_k", None)
    topk = topk or config_topk(getattr(experts, "config", None))
    if not topk:
        return f"the experts per token of {type(router).__qualname__} are not known"
    scoring = _hf_scoring(router, routing, int(count), int(topk))
    bias_of = _bias_reader(router)
    captured: dict[str, Any] = {"logits": None, "bias": None}
    handles = []

    def keep(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # A checkpointed recomputation may stop before the experts run and read the capture:
        # kept, its logits (and their graph) would live until the next forward.
        if in_backward():
            return
        if routing.logits_module is None:
            captured["logits"] = logits_of(output, routing.logits_at)
        captured["bias"] = bias_of(args, kwargs)

    handles.append(router.register_forward_hook(keep, with_kwargs=True))
    if routing.logits_module is not None:

        def keep_logits(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not in_backward():
                captured["logits"] = output

        handles.append(
            router.get_submodule(routing.logits_module).register_forward_hook(keep_logits)
        )

    def read(args: tuple, kwargs: dict, output: Any):
        logits, bias = captured["logits"], captured["bias"]
        captured["logits"] = captured["bias"] = None
        return logits, bias, None

    def release() -> None:
        for handle in handles:
            handle.remove()

    # The experts run exactly the ids they are handed, the router's top-k of the scores judged
    # (tests check the scoring chooses them, family by family); group-limited routing is
    # judged on group-masked scores, which the ids alone do not give.
    exact_ids = not scoring.grouped and scoring.num_experts == count

    def chosen(args: tuple, kwargs: dict, output: Any) -> torch.Tensor | None:
        index, _ = routing_args(args, kwargs)
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
            return None
        return index.reshape(index.shape[0], -1)

    return HealthSource(scoring, read, release, chosen=chosen if exact_ids else None)


def doge_health(block: nn.Module, parent: nn.Module | None) -> HealthSource | str:
    """Doge's product-key experts (``DogeCDMoE``): ``z`` built from its two key logit sets.

    Its ``router_gate`` gives, per token, ``num_keys`` logits ``x`` and ``num_keys`` logits
    ``y`` (split as its forward splits them); expert ``i * num_keys + j`` scores ``x_i + y_j``,
    and the block takes the top-k of all ``num_keys ** 2`` of these, weighted by a softmax over
    the chosen ones: a softmax router ranking its logits, ``z = x (+) y``.
    """
    keys, experts = int(block.num_keys), int(block.num_experts)
    if keys * keys != experts:
        return f"product keys: {keys} x {keys} keys reach {keys * keys} of its {experts} experts"
    routing = hf_routing(block)
    assert not isinstance(routing, str)
    scoring = _hf_scoring(block, routing, experts, int(block.top_k))
    captured: dict[str, Any] = {"logits": None}

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x, y = output.reshape(2, -1, keys)  # DogeCDMoE: .view(2, bsz * seq_len, -1)
        captured["logits"] = (x.unsqueeze(-1) + y.unsqueeze(-2)).reshape(-1, experts)

    handle = block.router_gate.register_forward_hook(keep)

    def read(args: tuple, kwargs: dict, output: Any):
        logits, captured["logits"] = captured["logits"], None
        return logits, None, None

    return HealthSource(scoring, read, handle.remove)
