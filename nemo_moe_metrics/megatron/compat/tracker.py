"""megatron-core's aux-loss tracker on either release: read, clear, reset, install entries;
megatron's own reduction of it (:func:`megatron_reduction_steps`, :func:`reduce_like_megatron`)
and its own per-step report (:func:`megatron_report`, the test oracle); the rerun state machine's
pass. Release differences: see :mod:`nemo_moe_metrics.megatron.compat`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nemo_moe_metrics.config.layer_pattern import config_hybrid_symbols, moe_flags_from_symbols

if TYPE_CHECKING:  # torch is imported where used: importing the adapter stays cheap
    import torch


@functools.cache
def _metrics_tracker_getter() -> Any | None:
    # Looked up once: on 0.16 each failed import searches the filesystem (about 0.1 ms), and
    # the tracker is read and cleared several times a step.
    try:
        moe_logging = importlib.import_module("megatron.core.transformer.moe.moe_logging")
    except ImportError:
        return None
    return getattr(moe_logging, "get_moe_metrics_tracker", None)


def _metrics_tracker() -> Any | None:
    """megatron's MoEMetricsTracker where the release has one (0.19), else None (0.16)."""
    getter = _metrics_tracker_getter()
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

        # Imported here, as torch is: the shims import torch, the adapter's import does not.
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
        return moe_flags_from_symbols(symbols)
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, (list, tuple)) else freq
