"""The rollout engine's own expert loads, stored beside training's.

A run directory may hold ``rollout_expert_loads.bin``: the same format and crash safety as
``expert_loads.bin`` (:mod:`nemo_moe_metrics.sinks.store_format`), one record per logged step
of what the rollout engine served: tokens routed to each expert of each MoE layer during
generation. It is fed by

- :func:`record_rollout_loads` / :class:`RolloutLoadRecorder`: counts you already have
  (``[MoE layers, experts]`` per step), e.g. from an in-process rollout's generation forwards;
- :func:`counts_from_routes`: the routes an engine returns (vLLM's ``routed_experts``,
  ``[tokens, MoE layers, top_k]`` or ``[batch, seq, MoE layers, top_k]``; negative ids are
  padding and count nothing), turned into such counts;
- ``nemo-moe-metrics ingest sglang DUMP`` (SGLang's expert distribution recorder,
  :mod:`nemo_moe_metrics.placement.sglang_dump`).

Runs written before this file existed have no rollout phase; nothing about them changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.sinks.store_format import StoreError, store_path
from nemo_moe_metrics.sinks.store_writer import ExpertLoadStore

__all__ = ["RolloutLoadRecorder", "counts_from_routes", "record_rollout_loads"]


def counts_from_routes(routes: Any, num_experts: int) -> np.ndarray:
    """``[MoE layers, num_experts]`` int64 token counts from engine routes ``[..., layers,
    top_k]`` (a torch tensor or array of integer expert ids; negative ids are padding)."""
    if hasattr(routes, "detach"):  # a torch tensor, on any device: one copy to the host
        routes = routes.detach().cpu().numpy()
    arr = np.asarray(routes)
    if arr.ndim < 3 or arr.dtype.kind not in "iu":
        raise StoreError(
            f"routes must be integer expert ids shaped [tokens, MoE layers, top_k] or [batch, "
            f"seq, MoE layers, top_k], got shape {arr.shape} dtype {arr.dtype}"
        )
    if num_experts < 1:
        raise StoreError(f"num_experts must be >= 1, got {num_experts}")
    layers = arr.shape[-2]
    per_layer = np.moveaxis(arr, -2, 0).reshape(layers, -1).astype(np.int64)
    if per_layer.size and per_layer.max() >= num_experts:
        raise StoreError(
            f"routes name expert {int(per_layer.max())} but num_experts is {num_experts}; "
            "pass the model's number of routed experts"
        )
    valid = per_layer >= 0
    offsets = np.arange(layers)[:, None] * num_experts
    flat = (per_layer + offsets)[valid]
    return np.bincount(flat, minlength=layers * num_experts).reshape(layers, num_experts)


class RolloutLoadRecorder:
    """Appends the rollout engine's expert loads of each step to a run's rollout store.

    Each ``record`` is durable (written and fsync'd) before it returns; ``close`` (or the
    ``with`` block) closes the file. A resumed run appends; a step stored again later wins
    when the store is read, as for training's loads.
    """

    def __init__(self, run_dir: Path, *, fsync: bool = True) -> None:
        self.path = store_path(run_dir, "rollout")
        self._store = ExpertLoadStore(self.path, fsync=fsync)

    def record(
        self,
        step: int,
        layer_ids: Sequence[int],
        counts: Any,
        widths: Sequence[int] | None = None,
    ) -> None:
        """Store ``counts[i, e]``: tokens the engine routed to expert ``e`` of global MoE
        layer ``layer_ids[i]`` (0-based, as training's) during step ``step``'s rollout."""
        self._store.append(step, layer_ids, np.asarray(counts), widths)

    def record_routes(
        self, step: int, layer_ids: Sequence[int], routes: Any, num_experts: int
    ) -> None:
        """Store the counts of engine routes ``[..., len(layer_ids), top_k]``
        (:func:`counts_from_routes`)."""
        counts = counts_from_routes(routes, num_experts)
        if counts.shape[0] != len(layer_ids):
            raise StoreError(
                f"routes hold {counts.shape[0]} MoE layers but {len(layer_ids)} layer ids "
                "were given; pass one global layer id per MoE layer of the routes"
            )
        self.record(step, layer_ids, counts)

    def close(self) -> None:
        """Close the store; closing twice is harmless."""
        self._store.close()

    def __enter__(self) -> RolloutLoadRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_rollout_loads(
    run_dir: Path,
    step: int,
    layer_ids: Sequence[int],
    counts: Any,
    widths: Sequence[int] | None = None,
) -> Path:
    """Append one step of the rollout engine's expert loads to ``run_dir``'s rollout store
    (opened and closed for this call); returns the store's path."""
    with RolloutLoadRecorder(run_dir) as recorder:
        recorder.record(step, layer_ids, counts, widths)
        return recorder.path
