"""How to do X on the installed megatron-core: the one place that knows release differences.

Supported lines (CI runs both): megatron-core 0.16.x (Python 3.11) and the newest 0.19.x
(Python 3.12). Every function here feature-detects (``hasattr`` / an import that may fail), never
compares version strings, and calls no megatron function that is deprecated on the installed
release. The rest of the package calls these functions and reads as if there were one megatron.

What differs, and how it is answered here:

- **Aux-loss tracker.** 0.16 keeps a module-level dict ``{name: {"values": tensor, ...}}``
  (``moe_utils.get_moe_layer_wise_logging_tracker()`` returns that dict itself). 0.19 keeps a
  ``MoEMetricsTracker`` object (``moe_logging.get_moe_metrics_tracker()``, entries
  ``metrics[name].values``); the old function is deprecated there and returns a *fresh copy*
  of the dict, so deleting or inserting entries through it changes nothing. The vectors have the
  same semantics on both: created on a name's first record with length ``num_layers +
  mtp_num_layers`` of the recording model and reused for every later model in the process.
  Hence :func:`reset_tracker` (drop every entry) before a model with another layer count.
- **Megatron's reduction of the tracker** (:func:`megatron_reduction_steps`): 0.19 averages
  over data parallel after ``avg_group`` and for every entry with ``needs_dp_avg`` (z-loss
  too); 0.16 only after a ``reduce_group`` without DP, before ``avg_group``.
- **Megatron's own reporting** (test oracle): ``track_moe_metrics`` on 0.16,
  ``get_moe_metrics_tracker().report(...)`` on 0.19 (the former is deprecated there).
- **Hybrid models.** 0.19: ``models.hybrid.HybridModel(hybrid_stack_spec=...,
  hybrid_layer_pattern=...)``; 0.16: ``models.mamba.MambaModel(mamba_stack_spec=...,
  hybrid_override_pattern=...)`` with the same layer symbols (``*``, ``-``, ``E``, ``M``; ``G``
  only on 0.19). Both stacks hard-code Transformer Engine's norm for the final layer norm and
  megatron's stock specs use Transformer Engine modules, so :func:`local_hybrid_stack_spec`
  builds one from megatron-core's local (non-TE) GPT modules instead.
- **Router replay and router logits** (:mod:`.routers`): the per-instance replay API and the
  ``gating`` call are the same on both; multi-token-prediction routers number their layers
  differently (:func:`router_tracker_index`).

The adapter is one package, one module per subject: :mod:`.tracker` (the aux-loss tracker, its
reduction and report), :mod:`.hybrid` (hybrid models), :mod:`.routers` (router ids, replay,
logits), :mod:`.parallel` (megatron's parallel state, read only where the program uses it). Import
the names from here. Which layers are MoE (hybrid symbols, ``moe_layer_freq``) is no release
difference: :mod:`nemo_moe_metrics.config.layer_pattern`.
"""

from __future__ import annotations

from nemo_moe_metrics.megatron.compat.hybrid import (
    build_hybrid_model,
    hybrid_model_class,
    local_hybrid_stack_spec,
    locally_supported_symbols,
    model_hybrid_pattern,
)
from nemo_moe_metrics.megatron.compat.parallel import (
    context_parallel_size,
    data_parallel_group,
    expert_parallel_group,
    parallel_state,
    pipeline_stage,
    tensor_parallel_replica,
)
from nemo_moe_metrics.megatron.compat.routers import (
    capture_router_choice,
    capture_router_logits,
    clear_router_replay,
    is_megatron_router,
    megatron_routers,
    pop_router_choice,
    pop_router_logits,
    release_router_logits,
    router_replay_active,
    router_replay_kwargs,
    router_replay_supported,
    router_tracker_index,
    set_router_replay,
)
from nemo_moe_metrics.megatron.compat.tracker import (
    clear_tracker,
    drop_tracker_entry,
    megatron_reduction_steps,
    megatron_report,
    megatron_reported_aux_losses,
    put_tracker_entry,
    reduce_like_megatron,
    rerun_pass,
    reset_tracker,
    tracker_values,
)

__all__ = [
    "build_hybrid_model",
    "capture_router_choice",
    "capture_router_logits",
    "clear_router_replay",
    "clear_tracker",
    "context_parallel_size",
    "data_parallel_group",
    "drop_tracker_entry",
    "expert_parallel_group",
    "hybrid_model_class",
    "is_megatron_router",
    "local_hybrid_stack_spec",
    "locally_supported_symbols",
    "megatron_reduction_steps",
    "megatron_report",
    "megatron_reported_aux_losses",
    "megatron_routers",
    "model_hybrid_pattern",
    "parallel_state",
    "pipeline_stage",
    "pop_router_choice",
    "pop_router_logits",
    "put_tracker_entry",
    "reduce_like_megatron",
    "release_router_logits",
    "rerun_pass",
    "reset_tracker",
    "router_replay_active",
    "router_replay_kwargs",
    "router_replay_supported",
    "router_tracker_index",
    "set_router_replay",
    "tensor_parallel_replica",
    "tracker_values",
]
