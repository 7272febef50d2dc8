"""Router aux-loss metrics from megatron-core's layer-wise tracker, with Megatron's semantics.

megatron-core's routers add each layer's auxiliary losses (coefficient excluded) into a
process-wide tracker, ``values[layer_number - 1] += loss``, once per training forward with grad
(a module dict on megatron-core 0.16, a ``MoEMetricsTracker`` on 0.19: read and cleared through
:mod:`nemo_moe_metrics.megatron.compat`, the one place that knows the difference).
At the end of an optimizer step this module turns that tracker into ``moe/`` scalars:

1. every tracked name is read on every rank, force-initialised to zeros where this rank recorded
   nothing (a pipeline stage without MoE layers), with the tracker's length
   ``num_layers + mtp_num_layers``, so every rank joins the same collectives (no hang);
2. each rank scales its own copy by ``1 / num_microbatches`` (the per-microbatch mean);
3. cross-rank reduction (:func:`reduce_aux_losses`): within a pipeline stage as Megatron does
   (load balancing: sum over the router's tensor+context group, mean over data parallel; global
   load balancing: sum over tensor+data+context), then a sum over the pipeline group, which
   assembles the stages' layers;
4. pure arithmetic (:func:`summarize_aux_losses`): mean over the MoE layers only, optional
   per-layer values keyed by the global 0-based layer index, a warning for NaN/inf;
5. megatron's tracker is cleared (``aux_loss_tracker: own``). With ``shared`` it is left
   untouched for the framework's own report, and step 3 reduces the copy with megatron's own
   collectives and groups instead, so the values equal that report's.

Deviations from megatron-core's ``track_moe_metrics``, each on purpose (docs/en/aux_loss.md):
the mean divides by the MoE layers the config really builds (MTP layers count only when the last
decoder layer is MoE, as the MTP block copies its spec); ``z_loss`` is averaged over the stage's
ranks instead of being left rank-local, so every rank reports the same value; the scale is applied
per rank before the reduction, so ranks with different microbatch counts still agree; means are
SUM all-reduces divided by the group size (older torch lacks gloo AVG); per-layer keys exist
for MoE layers only. Megatron's tracker is megatron's state: this module reads and clears it and
keeps none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from nemo_moe_metrics.config.layer_pattern import config_moe_layer_flags
from nemo_moe_metrics.export.host_read import Pending, done, read_once
from nemo_moe_metrics.export.metric_names import (
    AUX_LOSS_TRACKER_NAMES,
    REAL_TOKENS_LOSS,
    Z_LOSS,
    aux_loss_key,
    aux_loss_layer_key,
)
from nemo_moe_metrics.megatron import compat

logger = logging.getLogger(__name__)

# Names whose router reduce group is tensor+context parallel; Megatron then averages over DP
# (and the Hugging Face loss over real tokens, reduced as its padded twin).
_TP_CP_SUM_DP_MEAN = ("load_balancing_loss", "seq_load_balancing_loss", REAL_TOKENS_LOSS)
# Recorded with the tensor+data+context group (reduce_group_has_dp=True): a plain sum.
_TP_DP_CP_SUM = ("global_load_balancing_loss",)


def _load_balancing_coefficients(config: Any) -> dict[str, float]:
    """Load-balancing type -> coefficient, as the router's ``get_aux_loss_coeff`` reads them."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(types, str):
        types = [types]
        coeffs = [coeffs]
    elif not isinstance(coeffs, (list, tuple)):
        coeffs = [coeffs] * len(types)
    if len(coeffs) != len(types):
        raise ValueError(
            f"moe_aux_loss_coeff has {len(coeffs)} entries but moe_router_load_balancing_type "
            f"has {len(types)}; give one coefficient per load-balancing type"
        )
    return {t: float(c or 0.0) for t, c in zip(types, coeffs, strict=True)}


def tracked_aux_loss_names(config: Any) -> list[str]:
    """Tracker names the routers of this megatron ``TransformerConfig`` record.

    A load-balancing type counts only with a positive coefficient (the router records nothing
    otherwise); ``z_loss`` counts when ``moe_z_loss_coeff`` is not None. Exact matching: unlike
    ``"aux_loss" in "seq_aux_loss"`` (a substring test), ``seq_aux_loss`` does not add
    ``load_balancing_loss``. A dense model (no ``num_moe_experts``) tracks nothing.
    """
    if not getattr(config, "num_moe_experts", None):
        return []
    coeffs = _load_balancing_coefficients(config)
    names = [name for t, name in AUX_LOSS_TRACKER_NAMES.items() if coeffs.get(t, 0.0) > 0]
    if getattr(config, "moe_z_loss_coeff", None) is not None:
        names.append(Z_LOSS)
    return names


def tracker_length(config: Any) -> int:
    """Length of megatron's tracker vectors: decoder layers plus multi-token-prediction layers."""
    return config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)


def moe_layer_indices(config: Any) -> list[int]:
    """Global 0-based indices of the layers with a router (decoder MoE layers, then MTP layers).

    MTP layer ``j`` records at index ``num_layers + j``; it is MoE when the last decoder layer is,
    because megatron-core builds the MTP block from the last decoder layer's spec.
    """
    if not getattr(config, "num_moe_experts", None):
        return []
    pattern = config_moe_layer_flags(config)
    layers = [i for i, is_moe in enumerate(pattern) if is_moe]
    mtp = getattr(config, "mtp_num_layers", None) or 0
    if mtp and pattern and pattern[-1]:
        layers += [config.num_layers + j for j in range(mtp)]
    return layers


def _default_device() -> torch.device:
    # The tracker lives where the router's loss lives; NCCL needs CUDA tensors.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_aux_loss_values(config: Any, names: Sequence[str]) -> torch.Tensor:
    """This rank's tracker as a fresh ``[len(names), tracker_length]`` float32 tensor.

    Names this rank never recorded (a stage without MoE layers, no forward yet) are zeros, so
    every rank brings the same shape to the collectives. Megatron's tracker is not modified.
    """
    length = tracker_length(config)
    tracker = compat.tracker_values()
    rows = []
    device = None
    for name in names:
        values = tracker.get(name)
        if values is None:
            rows.append(None)
            continue
        if values.numel() != length:
            raise ValueError(
                f"megatron's aux-loss tracker holds {values.numel()} values for {name!r} but the "
                f"config says {length} (num_layers={config.num_layers} + mtp_num_layers="
                f"{getattr(config, 'mtp_num_layers', None)}); pass the model's own "
                "TransformerConfig so every rank agrees on the length. megatron keeps a name's "
                "vector for the whole process: after building a model with another layer count, "
                "call nemo_moe_metrics.megatron.compat.reset_tracker() first"
            )
        device = values.device
        rows.append(values.detach().float())
    device = device or _default_device()
    zeros = torch.zeros(length, dtype=torch.float32, device=device)
    return torch.stack([zeros if r is None else r.to(device) for r in rows])


def _mean_over(tensor: torch.Tensor, group: Any) -> None:
    # gloo implements no ReduceOp.AVG: sum, then divide by the group size.
    size = dist.get_world_size(group)
    if size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(size)


def _sum_over(tensor: torch.Tensor, group: Any) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _process_groups(pg_collection: Any | None) -> dict[str, Any]:
    """The four groups the reduction needs, from a ProcessGroupCollection or parallel_state."""
    if pg_collection is not None:
        missing = [g for g in ("pp", "tp_cp", "dp", "tp_dp_cp") if not hasattr(pg_collection, g)]
        if missing:
            raise ValueError(
                f"pg_collection lacks {missing}; give it pp, tp_cp, dp (without context "
                "parallel) and tp_dp_cp, or pass None to use megatron's parallel_state"
            )
        return {g: getattr(pg_collection, g) for g in ("pp", "tp_cp", "dp", "tp_dp_cp")}
    from megatron.core import parallel_state

    return {
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "tp_cp": parallel_state.get_tensor_and_context_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(
            with_context_parallel=False, partial_data_parallel=False
        ),
        "tp_dp_cp": parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
    }


def reduce_aux_losses(
    values: torch.Tensor, names: Sequence[str], *, pg_collection: Any | None = None
) -> torch.Tensor:
    """Reduce ``[names, layers]`` in place across ranks so every rank holds the same result.

    Collective: every rank must call it with the same names. Within the pipeline stage, per name,
    as Megatron's routers ask: load balancing and sequence load balancing are summed over the
    tensor+context group (each rank's share of the loss) and averaged over data parallel; global
    load balancing is summed over tensor+data+context (its share already spans DP); ``z_loss`` is
    a per-rank mean over its tokens, so it is averaged over tensor+data+context. Then one sum over
    the pipeline group joins the stages (each stage holds zeros for the others' layers). Doing the
    stage-local steps first gives Megatron's numbers and makes stages without MoE layers agree too.
    """
    groups = _process_groups(pg_collection)
    for row, name in enumerate(names):
        # Rows are views of ``values``: the in-place collectives write straight into it.
        if name in _TP_CP_SUM_DP_MEAN:
            _sum_over(values[row], groups["tp_cp"])
            _mean_over(values[row], groups["dp"])
        elif name in _TP_DP_CP_SUM:
            _sum_over(values[row], groups["tp_dp_cp"])
        elif name == Z_LOSS:
            _mean_over(values[row], groups["tp_dp_cp"])
        else:
            raise ValueError(
                f"no reduction rule for aux loss {name!r}; known: "
                f"{[*_TP_CP_SUM_DP_MEAN, *_TP_DP_CP_SUM, Z_LOSS]}"
            )
    _sum_over(values, groups["pp"])
    return values


def summarize_aux_losses(
    per_layer_values: Mapping[str, Sequence[float]],
    moe_layers: Sequence[int],
    *,
    per_layer: bool,
) -> dict[str, float]:
    """Pure arithmetic: ``moe/{name}`` = mean over ``moe_layers``; per-layer keys optionally.

    ``per_layer_values[name][i]`` is the (already reduced and scaled) value of global layer ``i``.
    Dense layers are excluded from the mean and get no key. NaN and inf are reported as they are,
    with one warning line per affected loss naming its layers.
    """
    if not moe_layers:
        raise ValueError(
            "no MoE layers to average over; check num_moe_experts and moe_layer_freq "
            "(aux-loss metrics exist only for models with MoE layers)"
        )
    moe_set = set(moe_layers)
    metrics: dict[str, float] = {}
    for name, layer_values in per_layer_values.items():
        length = len(layer_values)
        out_of_range = [i for i in moe_layers if not 0 <= i < length]
        if out_of_range:
            raise ValueError(
                f"MoE layer indices {out_of_range} are outside {name!r}'s {length} tracked layers"
            )
        selected = [float(layer_values[i]) for i in moe_layers]
        metrics[aux_loss_key(name)] = sum(selected) / len(selected)
        if per_layer:
            for i, value in zip(moe_layers, selected, strict=True):
                metrics[aux_loss_layer_key(name, i)] = value
        bad = [(i, v) for i, v in zip(moe_layers, selected, strict=True) if not math.isfinite(v)]
        if bad:
            where = ", ".join(f"layer {i}={v}" for i, v in bad)
            logger.warning(
                "%s is not finite in %s (global 0-based layers)", aux_loss_key(name), where
            )
        stray = [i for i in range(length) if i not in moe_set and layer_values[i] != 0]
        if stray:
            logger.warning(
                "%s recorded in layers %s, which the config says are dense; they are left out "
                "of the mean (check moe_layer_freq and mtp_num_layers against the model)",
                aux_loss_key(name),
                stray,
            )
    return metrics


def check_num_microbatches(num_microbatches: Any) -> int:
    """``num_microbatches`` when it is an int >= 1; a TypeError or ValueError naming the fix."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(
            f"num_microbatches must be an int (microbatches run in this optimizer step), "
            f"got {type(num_microbatches).__name__}"
        )
    if num_microbatches < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches}: pass the number of forward/backward "
            "microbatches in this optimizer step (>= 1)"
        )
    return num_microbatches


def clear_aux_loss_tracker() -> None:
    """Zero megatron's layer-wise aux-loss tracker (every name), as megatron-core does per step."""
    compat.clear_tracker()


def tracker_snapshot() -> dict[str, torch.Tensor]:
    """Device copies of megatron's tracker vectors, by name (no host read)."""
    return {name: values.detach().clone() for name, values in compat.tracker_values().items()}


def restore_tracker(snapshot: Mapping[str, torch.Tensor]) -> None:
    """Put megatron's tracker back to ``snapshot`` in place; names recorded since are zeroed."""
    for name, values in compat.tracker_values().items():
        before = snapshot.get(name)
        if before is None or before.shape != values.shape:
            values.zero_()
        else:
            values.copy_(before)


def aux_loss_metrics(
    config: Any,
    *,
    num_microbatches: int,
    per_layer: bool,
    pg_collection: Any | None = None,
    tracker: Literal["own", "shared"] = "own",
) -> dict[str, float]:
    """``moe/{name}`` (mean over MoE layers, per microbatch) and optional per-layer values.

    Collective: call it on EVERY rank once per optimizer step, after the step's last backward,
    with this rank's microbatch count for the step; every rank gets the same dict. ``config`` is
    the model's megatron ``TransformerConfig``. Clears megatron's tracker afterwards, unless
    ``tracker="shared"`` (see :func:`enqueue_aux_loss_metrics`).
    """
    pending = enqueue_aux_loss_metrics(
        config,
        num_microbatches=num_microbatches,
        per_layer=per_layer,
        pg_collection=pg_collection,
        tracker=tracker,
    )
    return read_once([pending])[0]


def enqueue_aux_loss_metrics(
    config: Any,
    *,
    num_microbatches: int,
    per_layer: bool,
    pg_collection: Any | None = None,
    tracker: Literal["own", "shared"] = "own",
) -> Pending[dict[str, float]]:
    """The first half of :func:`aux_loss_metrics`: launch the reduction, read nothing.

    The returned :class:`~nemo_moe_metrics.export.host_read.Pending` summarises the reduced values
    and, with ``tracker="own"``, clears megatron's tracker once the export's one host read happened.

    ``tracker="shared"`` leaves megatron's tracker exactly as it is (the framework's own report
    reads, reduces and clears it afterwards): a copy is reduced with megatron's own collectives
    and groups (:func:`nemo_moe_metrics.megatron.compat.reduce_like_megatron`), so the values
    equal that report's in the same step on every rank that logs.
    """
    check_num_microbatches(num_microbatches)
    if tracker not in ("own", "shared"):
        raise ValueError(f"tracker must be 'own' or 'shared', got {tracker!r}")
    own = tracker == "own"
    names = tracked_aux_loss_names(config)
    if not names:
        if own:
            clear_aux_loss_tracker()
        return done({})
    moe_layers = moe_layer_indices(config)
    values = local_aux_loss_values(config, names)  # a copy: megatron's tensors stay untouched
    # Scale before reducing: each rank's own count, so ranks with different counts still agree.
    values.div_(num_microbatches)
    if own:
        reduce_aux_losses(values, names, pg_collection=pg_collection)
    else:
        compat.reduce_like_megatron(values, names, pg_collection)

    def finish(host: list[np.ndarray]) -> dict[str, float]:
        metrics = summarize_aux_losses(
            dict(zip(names, host[0].tolist(), strict=True)), moe_layers, per_layer=per_layer
        )
        if own:
            clear_aux_loss_tracker()
        return metrics

    return Pending((values,), finish)
