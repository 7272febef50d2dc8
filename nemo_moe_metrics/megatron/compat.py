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
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and megatron are imported where used: config validation imports this
    import torch

# ----------------------------------------------------------------------------- aux-loss tracker


def _metrics_tracker() -> Any | None:
    """megatron's MoEMetricsTracker where the release has one (0.19), else None (0.16)."""
    try:
        moe_logging = importlib.import_module("megatron.core.transformer.moe.moe_logging")
    except ImportError:
        return None
    getter = getattr(moe_logging, "get_moe_metrics_tracker", None)
    return getter() if getter is not None else None


def _legacy_tracker() -> dict:
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.get_moe_layer_wise_logging_tracker()


def tracker_values() -> dict[str, torch.Tensor]:
    """Megatron's aux-loss tracker as ``{name: values [num_layers + mtp_num_layers]}``.

    The tensors are megatron's own (not copies): read them, do not keep them across a clear.
    """
    tracker = _metrics_tracker()
    if tracker is not None:
        return {name: entry.values for name, entry in tracker.metrics.items()}
    return {name: entry["values"] for name, entry in _legacy_tracker().items()}


def clear_tracker() -> None:
    """Zero every tracked value, keeping the entries (what megatron does after each step)."""
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    for entry in _legacy_tracker().values():
        entry["values"].zero_()


def reset_tracker() -> None:
    """Drop every tracker entry, so the next model records vectors of its own length.

    Needed when a process builds a model with another ``num_layers`` (or ``mtp_num_layers``)
    after one that already recorded: megatron reuses an existing entry's vector.
    """
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.metrics.clear()
    else:
        _legacy_tracker().clear()


def put_tracker_entry(name: str, values: torch.Tensor) -> None:
    """Install ``values`` as megatron's tracker vector for ``name`` (tests, fault injection)."""
    tracker = _metrics_tracker()
    if tracker is not None:
        from megatron.core.transformer.moe.moe_logging import MetricEntry

        tracker.metrics[name] = MetricEntry(values=values)
    else:
        _legacy_tracker()[name] = {
            "values": values,
            "reduce_group": None,
            "avg_group": None,
            "reduce_group_has_dp": False,
        }


def drop_tracker_entry(name: str) -> None:
    """Remove ``name`` from megatron's tracker if present."""
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.metrics.pop(name, None)
    else:
        _legacy_tracker().pop(name, None)


def _data_parallel_group(pg_collection: Any | None, *, remat: bool) -> Any:
    if pg_collection is not None:
        group = getattr(pg_collection, "dp_cp_gtp_remat", None) if remat else None
        if group is None and not remat:
            group = pg_collection.dp
        if group is not None:
            return group
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(
        with_context_parallel=False, partial_data_parallel=False
    )


def megatron_reduction_steps(name: str, pg_collection: Any | None = None) -> list[tuple[str, Any]]:
    """The collectives megatron's own report applies to tracker entry ``name``, in its order.

    ``[("sum" | "avg", group), ...]``, read from the groups the router recorded with the entry
    (none for an entry this rank never recorded: megatron force-initialises it bare). 0.19
    (``MoEMetricsTracker._sync_metrics``): pipeline sum, ``reduce_group`` sum, ``avg_group``
    mean, then the data-parallel mean when ``needs_dp_avg``. 0.16
    (``reduce_aux_losses_tracker_across_ranks``): pipeline sum, ``reduce_group`` sum followed by
    the data-parallel mean unless ``reduce_group_has_dp``, then ``avg_group`` mean.
    """
    from megatron.core import parallel_state

    pp = (
        pg_collection.pp
        if pg_collection is not None
        else parallel_state.get_pipeline_model_parallel_group()
    )
    steps: list[tuple[str, Any]] = [("sum", pp)]
    tracker = _metrics_tracker()
    if tracker is not None:
        entry = tracker.metrics.get(name)
        reduce_group = getattr(entry, "reduce_group", None)
        avg_group = getattr(entry, "avg_group", None)
        if reduce_group is not None:
            steps.append(("sum", reduce_group))
        if avg_group is not None:
            steps.append(("avg", avg_group))
        if getattr(entry, "needs_dp_avg", True):
            steps.append(("avg", _data_parallel_group(pg_collection, remat=True)))
        return steps
    entry = _legacy_tracker().get(name) or {}
    if entry.get("reduce_group") is not None:
        steps.append(("sum", entry["reduce_group"]))
        if not entry.get("reduce_group_has_dp", False):
            steps.append(("avg", _data_parallel_group(pg_collection, remat=False)))
    if entry.get("avg_group") is not None:
        steps.append(("avg", entry["avg_group"]))
    return steps


def reduce_like_megatron(
    values: torch.Tensor, names: Sequence[str], pg_collection: Any | None = None
) -> torch.Tensor:
    """Reduce ``values`` (``[names, layers]``, a copy of the tracker) in place across ranks
    exactly as megatron's report reduces its tracker; megatron's tracker is not touched.

    Collective: every rank calls it with the same names, as megatron's report does.
    """
    import torch.distributed as dist

    for row, name in enumerate(names):
        for op, group in megatron_reduction_steps(name, pg_collection):
            if dist.get_world_size(group) == 1:
                continue
            if op == "sum":
                dist.all_reduce(values[row], op=dist.ReduceOp.SUM, group=group)
            else:
                dist.all_reduce(values[row], op=dist.ReduceOp.AVG, group=group)
    return values


def rerun_pass() -> tuple[int, str]:
    """Which pass of megatron's rerun state machine is running: ``(iteration, state)``.

    Within one training step, a change means the forward-backward runs again
    (``should_run_forward_backward`` returned True once more). Both lines have the machine.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    return int(machine.current_iteration), str(getattr(machine.state, "name", machine.state))


class _ScalarCapture:
    """A TensorBoard-writer stand-in that keeps what megatron writes: ``{tag: float}``."""

    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, tag: str, value: Any, step: int | None = None) -> None:
        self.scalars[tag] = float(value)


def megatron_report(
    config: Any,
    *,
    loss_scale: float,
    iteration: int,
    track_names: Sequence[str],
    writer: Any = None,
    wandb_writer: Any = None,
    total_loss_dict: dict | None = None,
    per_layer: bool = False,
    force_initialize: bool = True,
    pg_collection: Any | None = None,
) -> None:
    """Megatron's own per-step aux-loss report, called as ``training_log`` calls it; clears it.

    ``get_moe_metrics_tracker().report`` where it exists (0.19), else
    ``moe_utils.track_moe_metrics`` (0.16), with megatron's own ``num_layers``,
    ``moe_layer_freq`` and ``mtp_num_layers`` from ``config``. Collective over megatron's groups.
    """
    kwargs = dict(
        loss_scale=loss_scale,
        iteration=iteration,
        writer=writer,
        wandb_writer=wandb_writer,
        total_loss_dict=total_loss_dict,
        per_layer_logging=per_layer,
        force_initialize=force_initialize,
        track_names=list(track_names),
        num_layers=config.num_layers,
        moe_layer_freq=_moe_layer_freq_for_report(config),
        mtp_num_layers=getattr(config, "mtp_num_layers", None),
        pg_collection=pg_collection,
    )
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.report(**kwargs)
    else:
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        from nemo_moe_metrics.megatron.cpu_shims import cpu_device_mode

        # 0.16 force-initialises missing names with device="cuda" (rewritten to the CPU here;
        # a no-op with CUDA). Its force-initialised length leaves MTP layers out: a known 0.16
        # mismatch this reproduces rather than hides.
        with cpu_device_mode():
            track_moe_metrics(**kwargs)


def megatron_reported_aux_losses(
    config: Any,
    *,
    num_microbatches: int,
    track_names: Sequence[str],
    per_layer: bool = True,
    force_initialize: bool = True,
    pg_collection: Any | None = None,
) -> dict[str, float]:
    """What megatron-core's own per-step reporting logs for the tracker now; clears it.

    :func:`megatron_report` with a writer that captures the scalars. Keys are returned in this
    package's naming: ``moe/{name}`` for megatron's ``{name}`` and the per-layer
    ``moe/{name}_layer_{i}`` unchanged (megatron writes one per layer, dense layers included).
    Collective over megatron's groups, like megatron's call. For test oracles and comparisons.
    """
    writer = _ScalarCapture()
    megatron_report(
        config,
        loss_scale=1.0 / num_microbatches,
        iteration=0,
        track_names=track_names,
        writer=writer,
        per_layer=per_layer,
        force_initialize=force_initialize,
        pg_collection=pg_collection,
    )
    return {
        (tag if tag.startswith("moe/") else f"moe/{tag}"): value
        for tag, value in writer.scalars.items()
    }


def _moe_layer_freq_for_report(config: Any) -> Any:
    symbols = config_hybrid_symbols(config)
    if symbols is not None:
        return [1 if s == MOE_SYMBOL else 0 for s in symbols]
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, (list, tuple)) else freq


# ----------------------------------------------------------------------------- hybrid patterns
# megatron-core's hybrid layer symbols (models/hybrid/hybrid_layer_allocation.Symbols).
MAMBA_SYMBOL = "M"
GDN_SYMBOL = "G"
ATTENTION_SYMBOL = "*"
DS_ATTENTION_SYMBOL = "D"
MLA_SYMBOL = "+"
MLP_SYMBOL = "-"
MOE_SYMBOL = "E"
PIPE_SYMBOL = "|"
MTP_SEPARATOR = "/"
LAYER_SYMBOLS = (
    MAMBA_SYMBOL,
    GDN_SYMBOL,
    ATTENTION_SYMBOL,
    DS_ATTENTION_SYMBOL,
    MLA_SYMBOL,
    MLP_SYMBOL,
    MOE_SYMBOL,
)


def hybrid_layer_symbols(pattern: str) -> list[str]:
    """One symbol per decoder layer of a hybrid pattern; ``|`` (pipeline cuts) is dropped.

    Layer ``i`` of the returned list is the hybrid stack's layer ``i`` (megatron's
    ``layer_number = i + 1``). Multi-token-prediction parts (after ``/``) are rejected.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid layer pattern must be a non-empty string, got {pattern!r}")
    if MTP_SEPARATOR in pattern:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has a multi-token-prediction part ('/'), which "
            "nemo_moe_metrics does not support for hybrid models; drop the '/...' suffix"
        )
    symbols = [s for s in pattern if s != PIPE_SYMBOL]
    bad = sorted({s for s in symbols if s not in LAYER_SYMBOLS})
    if bad or not symbols:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has unknown symbols {bad}; use M (Mamba), "
            "G (Gated DeltaNet), * (attention), D (DeepSeek attention), + (MLA), - (MLP), "
            "E (MoE) and | (pipeline stage boundary)"
        )
    return symbols


def config_hybrid_pattern(config: Any) -> str | None:
    """The hybrid layer pattern a config carries, if any.

    Read from ``hybrid_layer_pattern`` (megatron-core 0.19 naming, Megatron-Bridge's hybrid
    providers) or ``hybrid_override_pattern`` (0.16 and older providers); works on config
    objects and plain dicts. A plain ``TransformerConfig`` has neither: set the attribute on it.
    """
    for key in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value:
            return str(value)
    return None


def config_hybrid_symbols(config: Any) -> list[str] | None:
    """:func:`hybrid_layer_symbols` of the config's pattern, or None for a non-hybrid config."""
    pattern = config_hybrid_pattern(config)
    return None if pattern is None else hybrid_layer_symbols(pattern)


# ----------------------------------------------------------------------------- hybrid models


def model_hybrid_pattern(model: Any) -> str | None:
    """The hybrid layer pattern a built model holds, or None for a non-hybrid model.

    0.19's ``HybridModel`` keeps it as ``hybrid_layer_pattern`` (also when it was given as the
    deprecated ``hybrid_override_pattern`` or ratios), 0.16's ``MambaModel`` as
    ``hybrid_override_pattern``; 0.16 built from ratios leaves that None and only its stack's
    ``layer_type_list`` has the layers (the whole model's only without pipeline parallelism).
    Wrappers (DDP, ``Float16Module``) are looked through: any submodule may hold it.
    """
    stack_layers = None
    for module in model.modules():
        for key in ("hybrid_layer_pattern", "hybrid_override_pattern"):
            value = getattr(module, key, None)
            if isinstance(value, str) and value:
                return value
        types = getattr(module, "layer_type_list", None)
        single_stage = getattr(module, "config", None)
        single_stage = getattr(single_stage, "pipeline_model_parallel_size", 1) == 1
        if stack_layers is None and isinstance(types, list) and types and single_stage:
            stack_layers = "".join(str(t) for t in types)
    return stack_layers


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


def hybrid_model_class() -> tuple[type, str, str]:
    """``(model class, spec keyword, pattern keyword)`` of this release's hybrid model.

    0.19: ``HybridModel(hybrid_stack_spec=..., hybrid_layer_pattern=...)``; 0.16:
    ``MambaModel(mamba_stack_spec=..., hybrid_override_pattern=...)``.
    """
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel

        return MambaModel, "mamba_stack_spec", "hybrid_override_pattern"
    return HybridModel, "hybrid_stack_spec", "hybrid_layer_pattern"


def _stack_classes() -> tuple[type, type]:
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    except ImportError:
        from megatron.core.ssm.mamba_block import MambaStack as HybridStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as HybridStackSubmodules
    return HybridStack, HybridStackSubmodules


def locally_supported_symbols() -> set[str]:
    """Hybrid symbols :func:`local_hybrid_stack_spec` builds: attention, MLP and MoE layers.

    Mamba (``M``) needs the ``mamba-ssm`` CUDA kernels, Gated DeltaNet (``G``) the
    ``flash-linear-attention`` Triton kernels, and megatron-core builds both (and ``D``, ``+``)
    only from Transformer Engine specs.
    """
    return {ATTENTION_SYMBOL, MLP_SYMBOL, MOE_SYMBOL}


_LOCAL_STACK: dict[str, type] = {}


def _local_final_norm_stack() -> type:
    """The release's hybrid stack with the final norm built from megatron's local norm.

    Both ``HybridStack`` (0.19) and ``MambaStack`` (0.16) create ``TENorm`` for their final
    layer norm, which needs Transformer Engine. This subclass builds the stack without it and
    adds megatron-core's ``WrappedTorchNorm`` under the same name (``final_norm``).
    """
    if "cls" not in _LOCAL_STACK:
        stack_cls, _ = _stack_classes()

        def __init__(self, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
            stack_cls.__init__(self, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                from megatron.core.transformer.torch_norm import WrappedTorchNorm

                self.final_norm = WrappedTorchNorm(
                    config=self.config,
                    hidden_size=self.config.hidden_size,
                    eps=self.config.layernorm_epsilon,
                )

        _LOCAL_STACK["cls"] = type(
            f"Local{stack_cls.__name__}",
            (stack_cls,),
            {"__init__": __init__, "__module__": __name__},
        )
    return _LOCAL_STACK["cls"]


def local_hybrid_stack_spec(num_experts: int | None) -> Any:
    """A hybrid stack spec from megatron-core's local (non-TE) GPT modules: ``*``, ``-``, ``E``.

    Each layer type is a slice of megatron's own ``get_gpt_layer_local_spec``: ``*`` its
    input norm + self-attention, ``-`` its pre-MLP norm + dense MLP (``MLPLayer``), ``E`` its
    pre-MLP norm + MoE block (``MoETransformerLayer`` where the release has it).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer import transformer_layer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    stack_cls = _local_final_norm_stack()
    _, submodules_cls = _stack_classes()
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    fields = {
        "attention_layer": ModuleSpec(
            module=transformer_layer.TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=dense.input_layernorm,
                self_attention=dense.self_attention,
                self_attn_bda=dense.self_attn_bda,
            ),
        ),
        "mlp_layer": ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=dense.pre_mlp_layernorm,
                mlp=dense.mlp,
                mlp_bda=dense.mlp_bda,
            ),
        ),
    }
    if num_experts:
        moe = get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
        ).submodules
        fields["moe_layer"] = ModuleSpec(
            module=getattr(
                transformer_layer, "MoETransformerLayer", transformer_layer.TransformerLayer
            ),
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda
            ),
        )
    known = {f.name for f in dataclasses.fields(submodules_cls)}
    return ModuleSpec(
        module=stack_cls,
        submodules=submodules_cls(**{k: v for k, v in fields.items() if k in known}),
    )


def build_hybrid_model(
    config: Any,
    pattern: str,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
) -> torch.nn.Module:
    """This release's hybrid language model for ``pattern``, built from local modules.

    Raises a clear error for symbols the local spec cannot build (see
    :func:`locally_supported_symbols`), instead of megatron's silent identity layers.
    """
    symbols = hybrid_layer_symbols(pattern)
    unsupported = sorted(set(symbols) - locally_supported_symbols())
    if unsupported:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} uses {unsupported}, which nemo_moe_metrics' "
            "reference model builds only from attention (*), MLP (-) and MoE (E) layers: "
            "Mamba (M) needs the mamba-ssm CUDA kernels, Gated DeltaNet (G) the "
            "flash-linear-attention Triton kernels, and megatron-core builds them from "
            "Transformer Engine specs; build such a model with megatron's own hybrid_stack_spec"
        )
    if len(symbols) != config.num_layers:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has {len(symbols)} layers but the "
            f"TransformerConfig has num_layers={config.num_layers}; they must agree"
        )
    model_cls, spec_kw, pattern_kw = hybrid_model_class()
    return model_cls(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        **{spec_kw: local_hybrid_stack_spec(config.num_moe_experts), pattern_kw: pattern},
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
        setattr(router, _LOGITS, logits)
        return logits

    setattr(router, _GATING, original)
    router.gating = gating


def pop_router_logits(router: Any) -> torch.Tensor | None:
    """The logits ``[s, b, E]`` of the router's last forward (once), or None."""
    logits = getattr(router, _LOGITS, None)
    if logits is not None:
        setattr(router, _LOGITS, None)
    return logits


def release_router_logits(router: Any) -> None:
    """Undo :func:`capture_router_logits`: the class's ``gating`` again, nothing kept."""
    if getattr(router, _GATING, None) is None:
        return
    router.__dict__.pop("gating", None)
    setattr(router, _GATING, None)
    setattr(router, _LOGITS, None)
