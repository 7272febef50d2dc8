"""The router contract: how one router class is read (:class:`RouterSpec`), and layer naming.

Every model family (``nemo_moe_metrics.adapters``) describes its routers with a
:class:`RouterSpec`; the collector (``moe.collector``) hooks them and knows no family. A spec's
functions run inside forward hooks, so they only launch device ops (no ``.item()``,
``.tolist()``, ``.cpu()``, ``nonzero`` or branching on values).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nemo_moe_metrics.moe.router_health import RouterScoring

# counts_fn(module, args, kwargs, output) -> (counts, tokens[, executed[, zero_picks]]):
#   counts: routed assignments of non-padding tokens, per-expert integer counts [E] or a boolean
#     assignment map [T, E] (summed over T);
#   tokens: tokens the router saw (non-padding), a 0-d integer tensor or a Python int;
#   executed (optional, same forms as counts, None = counts): what the dispatcher hands to the
#     experts, padding included; omitted when the router cannot see padding;
#   zero_picks (optional, 0-d): top-k picks of zero-computation experts (not in counts).
CountsFn = Callable[[nn.Module, tuple, dict, Any], tuple]

#: ``read(args, kwargs, output) -> (logits or None, expert bias [E] or None, valid [T] or None)``
HealthReader = Callable[[tuple, dict, Any], tuple[Any, Any, Any]]


@dataclass(frozen=True)
class HealthSource:
    """How to judge one router: its scoring, a per-forward reader, and how to undo captures.

    ``chosen(args, kwargs, output)``, where the router returns it: the router's own decision
    as a ``[T, E]`` bool map or ``[T, k]`` int64 expert ids when it is exactly the top-k of the
    scoring's selection scores in that forward (else None), so the judging needs no top-k of
    its own.
    """

    scoring: RouterScoring
    read: HealthReader
    release: Callable[[], None] | None = None
    chosen: Callable[[tuple, dict, Any], torch.Tensor | None] | None = None


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
    # picks_fn(module, args, kwargs, output, valid=None) -> (picks, real rows [T] bool or
    #   None): the forward's picks as [T, k] expert ids or a [T, E] bool map, where counts_fn's
    #   counts are exactly the picks of the real rows (executed: of every row); the collector
    #   keeps them and counts the kept forwards together (moe.layer_counts); counts_fn still
    #   counts generation forwards.
    picks_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None
    # routes_fn(module, args, kwargs, output) -> (own choice: [T, E] bool map or [T, k] expert
    #   ids, executed [T, E] bool (read only under replay), non-padding tokens [T] bool or None,
    #   replay active): for routing consistency. Ids compare directly (no [T, E] map built).
    routes_fn: Callable[[nn.Module, tuple, dict, Any], tuple] | None = None
    #: called once per compared decoder router when routing consistency is on, for a router
    #: whose executed experts can differ from its own choice (megatron's router replay)
    capture_choice: Callable[[nn.Module], None] | None = None
    sequence_major: bool = False  #: router token order [s, b] (megatron) or [b, s]
    #: the submodule whose forward the hook reads (default: the matched module itself); the
    #: count and route functions receive it, num_experts/topk/layer_id the matched module.
    hooked: Callable[[nn.Module], nn.Module] | None = None
    zero_computation: bool = False  #: counts_fn reports picks of zero-computation experts
    # health(router, parent) -> HealthSource or a string saying why its decisions cannot be
    #   judged; called once per router when track_router_health is on.
    health: Callable[[nn.Module, nn.Module | None], HealthSource | str] | None = None
    #: the counted experts see only some of the layer's tokens by design (ernie4_5_vl_moe's
    #: text experts: image and video tokens go to its vision experts)
    token_subset: bool = False
    #: the router sees no padding mask (Hugging Face): the collector reads the real-token mask
    #: of the model forward the router serves (its 2-D ``attention_mask``) and passes it as
    #: ``valid=`` ([T] bool, or None when there is none) to ``counts_fn`` and ``routes_fn``
    padding_from_model: bool = False


def count_experts(
    index: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Assignments per expert ``[num_experts]`` (int64) of expert ids ``index`` (any shape).

    ``keep`` (same shape, bool or 0/1) counts only some of them. ``scatter_add_`` into a fixed
    size: ``bincount`` / ``one_hot`` would read ``max(index)`` on the host.
    """
    flat = index.reshape(-1).to(torch.int64)
    ones = torch.ones_like(flat) if keep is None else keep.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, ones)


def in_backward() -> bool:
    """Whether autograd's backward is running (where activation checkpointing replays forwards:
    nothing there is counted or captured)."""
    # The engine has a graph task inside backward. Compiled graphs never replay Python hooks,
    # and dynamo cannot trace this call.
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def rows_of(valid: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``valid`` when it describes ``rows`` token rows (a shape check, no sync), else None.

    The model forward's mask covers every token of the forward; a router that sees a subset
    (ernie4_5_vl_moe's text experts) or a reshaped batch gets no mask and counts every row.
    """
    return valid if valid is not None and valid.numel() == rows else None


def per_expert(counts: torch.Tensor) -> torch.Tensor:
    """Counts ``[E]`` (int64) from per-expert counts or a ``[T, E]`` assignment map."""
    if counts.dtype == torch.bool or counts.dim() == 2:
        counts = counts.sum(dim=0)
    # A Python check, not a .to(): the hot path's counts are int64 already (a dispatch saved).
    return counts if counts.dtype == torch.int64 else counts.to(torch.int64)


def logits_of(output: Any, index: int) -> torch.Tensor:
    """The router logits in a router's output (a tensor output is the logits itself)."""
    return output[index] if isinstance(output, tuple | list) else output


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


def in_decoder_layer(name: str) -> bool:
    """Whether a module's qualified name sits inside a numbered decoder layer."""
    return _LAYER_RE.search(name) is not None


def mtp_index(name: str) -> int | None:
    """``j`` for a module inside the j-th multi-token-prediction layer, else None."""
    found = _MTP_RE.search(name)
    return None if found is None else int(found.group(1))


def same_layer_message(first: str, second: str, layer: int) -> str:
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
