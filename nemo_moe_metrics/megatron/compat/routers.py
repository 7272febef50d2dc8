"""megatron-core's routers on either release: a router's layer id in the aux-loss tracker, the
``TopKRouter`` test, router replay (R3: set, clear, and the router's own choice under replay)
and the logits a router routes (for router health), captured without a second matmul. Release
differences: see :mod:`nemo_moe_metrics.megatron.compat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: importing the adapter stays cheap
    import torch


def router_tracker_index(router: Any) -> int | None:
    """The 0-based index a router records its aux losses at: its global layer id.

    Decoder routers: ``layer_number - 1``. Multi-token-prediction routers record after the
    decoder layers, at ``num_layers + j``: 0.16 numbers their layers on from the decoder
    (``layer_number = num_layers + 1 + j``), 0.19 numbers them from 1 and marks them
    ``is_mtp_layer`` (the router adds ``num_layers`` when it records). None before the router
    knows its layer.
    """
    number = getattr(router, "layer_number", None)
    if number is None:
        return None
    if getattr(router, "is_mtp_layer", False):
        number += int(router.config.num_layers)
    return int(number) - 1


def is_megatron_router(module: Any) -> bool:
    """True for megatron-core's ``TopKRouter`` (or a subclass), without importing megatron."""
    return any(
        cls.__name__ == "TopKRouter" and cls.__module__ == "megatron.core.transformer.moe.router"
        for cls in type(module).__mro__
    )


# ------------------------------------------------------------------- router replay (R3)
# Both lines ship transformer/moe/router_replay.py: TransformerConfig(moe_enable_routing_replay=
# True) gives every TopKRouter a `router_replay` (RouterReplay) whose get_replay_topk(scores, topk,
# num_groups, group_topk, default_compute_topk) picks the experts. 0.19 adds static buffers for
# CUDA graphs and a layer_number; the per-instance API used here is the same on both. The
# class-level `global_router_replay_instances` list grows with every model built in a process,
# so replay data is set per router instance, never through the static set_replay_data().

_OWN_TOPK = "_nemo_moe_metrics_own_topk"
_WRAPPED = "_nemo_moe_metrics_wrapped"
_REPLAY_ACTIONS = ("replay_forward", "replay_backward")


def router_replay_supported() -> bool:
    """Whether the installed megatron-core has router replay (``moe_enable_routing_replay``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "moe_enable_routing_replay" in {f.name for f in dataclasses.fields(TransformerConfig)}


def router_replay_kwargs(enabled: bool) -> dict[str, Any]:
    """TransformerConfig keyword arguments that turn router replay on (empty when off)."""
    if not enabled:
        return {}
    if not router_replay_supported():
        raise RuntimeError(
            "moe_enable_routing_replay needs megatron-core with transformer/moe/router_replay.py "
            "(0.16 or newer)"
        )
    return {"moe_enable_routing_replay": True}


def _action_name(replay: Any) -> str | None:
    action = getattr(replay, "router_replay_action", None)
    return getattr(action, "value", None)


def router_replay_active(router: Any) -> bool:
    """Whether ``router`` (a TopKRouter) replays given routes in its current forward."""
    replay = getattr(router, "router_replay", None)
    return replay is not None and _action_name(replay) in _REPLAY_ACTIONS


def capture_router_choice(router: Any) -> bool:
    """Make ``router``'s own top-k (from its scores) readable even while replay overrides it.

    Wraps this router's RouterReplay instance (not the class): every top-k it is asked for also
    stores the indices the live router would choose, read once by :func:`pop_router_choice`.
    Under replay, rows of the target holding ``-1`` fall back on that live choice (NeMo RL's
    convention for tokens without a rollout route; megatron-core would index out of range).
    Returns False when the router has no RouterReplay (replay off: its routing map is its own
    choice). Idempotent.
    """
    replay = getattr(router, "router_replay", None)
    if replay is None:
        return False
    if getattr(replay, _WRAPPED, False):
        return True
    import torch

    original = replay.get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = _action_name(replay)
        if action not in _REPLAY_ACTIONS:
            probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
            setattr(router, _OWN_TOPK, idx)
            return probs, idx
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        setattr(router, _OWN_TOPK, own)
        if action == "replay_forward" and replay.target_topk_idx is not None:
            target = replay.target_topk_idx.to(own.device)
            replay.target_topk_idx = torch.where((target < 0).any(-1, keepdim=True), own, target)
        elif action == "replay_backward" and replay.replay_backward_list:
            target = replay.replay_backward_list[0].to(own.device)
            replay.replay_backward_list[0] = torch.where(
                (target < 0).any(-1, keepdim=True), own, target
            )
        return original(scores, topk, num_groups, group_topk, default_compute_topk)

    replay.get_replay_topk = get_replay_topk
    setattr(replay, _WRAPPED, True)
    return True


def pop_router_choice(router: Any) -> torch.Tensor | None:
    """The top-k indices ``[tokens, k]`` the router chose itself in its last forward, or None."""
    own = getattr(router, _OWN_TOPK, None)
    if own is not None:
        setattr(router, _OWN_TOPK, None)
    return own


def megatron_routers(model: Any) -> list[Any]:
    """The model's TopKRouters (MTP excluded) ordered by ``layer_number``."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model if isinstance(model, list | tuple) else [model]
    found = [
        m
        for c in chunks
        for name, m in c.named_modules()
        if isinstance(m, TopKRouter) and "mtp" not in name.split(".")
    ]
    return sorted(found, key=lambda r: int(r.layer_number))


def set_router_replay(routers: Sequence[Any], indices: Sequence[torch.Tensor]) -> None:
    """Replay ``indices[j]`` (``[tokens, k]``, router token order, ``-1`` = live choice) in
    router ``j``'s next forwards."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if len(routers) != len(indices):
        raise ValueError(f"{len(indices)} replay tensors for {len(routers)} routers")
    for router, idx in zip(routers, indices, strict=True):
        replay = router.router_replay
        if replay is None:
            raise RuntimeError("router replay is off in the TransformerConfig")
        capture_router_choice(router)  # the -1 fallback
        replay.clear_indices()
        replay.set_target_indices(idx)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_router_replay(routers: Sequence[Any]) -> None:
    """Back to live routing: clear every router's replay targets and action."""
    for router in routers:
        replay = getattr(router, "router_replay", None)
        if replay is not None:
            replay.clear_indices()
            replay.clear_router_replay_action()


# ------------------------------------------------------------------- router logits (health)
# Both lines compute `logits = self.gating(input)` in TopKRouter.forward (0.19 then may replace
# them with random logits for benchmarks, which router health refuses), so wrapping `gating` on
# the instance sees exactly the logits the router routes, without a second matmul.

_LOGITS = "_nemo_moe_metrics_logits"
_GATING = "_nemo_moe_metrics_gating"


def capture_router_logits(router: Any) -> None:
    """Keep the logits ``router.gating`` returns in each forward, for :func:`pop_router_logits`.

    Wraps this instance's ``gating`` (not the class); idempotent; undone by
    :func:`release_router_logits`.
    """
    if getattr(router, _GATING, None) is not None:
        return
    original = router.gating

    def gating(input: Any) -> Any:
        logits = original(input)
        # The instance dict, not setattr: nn.Module.__setattr__ checks parameters and buffers
        # first (a few us a forward); this name is neither.
        router.__dict__[_LOGITS] = logits
        return logits

    setattr(router, _GATING, original)
    router.gating = gating


def pop_router_logits(router: Any) -> torch.Tensor | None:
    """The logits ``[s, b, E]`` of the router's last forward (once), or None."""
    return router.__dict__.pop(_LOGITS, None)


def release_router_logits(router: Any) -> None:
    """Undo :func:`capture_router_logits`: the class's ``gating`` again, nothing kept."""
    if getattr(router, _GATING, None) is None:
        return
    router.__dict__.pop("gating", None)
    setattr(router, _GATING, None)
    router.__dict__.pop(_LOGITS, None)
