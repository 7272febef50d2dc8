"""SGLang's expert distribution recorder dumps, read safely and stored as rollout loads.

What SGLang writes (read in sgl-project/sglang ``python/sglang/srt/eplb/expert_distribution.py``,
``_StatAccumulator.dump``): with ``--expert-distribution-recorder-mode stat``, rank 0 writes
``expert_distribution_recorder_{time}.pt`` with ``torch.save`` of a dict

- ``logical_count``: an integer tensor ``[passes, layers, logical experts]``, tokens routed to
  each expert of each layer in each recorded forward pass (summed over ranks; a circular buffer
  leaves passes not yet recorded at 0),
- ``rank`` (int) and ``average_utilization_rate_over_window`` (float or None).

Layer ``l`` is the model's decoder layer ``l`` (0-based, the same global id as ours); layers
without routed experts (DeepSeek's first dense layers) are all zero and are not stored.

The file is loaded with ``torch.load(weights_only=True)``: tensors and plain containers only,
so a pickle that carries code is refused before anything in it runs. Anything but the dict
above (``per_token`` dumps, other objects, other shapes) is refused with the reason.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemo_moe_metrics.sinks.rollout_store import RolloutLoadRecorder

__all__ = ["SglangDump", "SglangDumpError", "ingest_sglang_dump", "read_sglang_dump"]

_KNOWN_KEYS = {"logical_count", "rank", "average_utilization_rate_over_window"}


class SglangDumpError(ValueError):
    """The file is not an SGLang expert distribution dump of the ``stat`` mode."""


@dataclass(frozen=True)
class SglangDump:
    """One dump: ``logical_count [passes, layers, experts]`` int64."""

    path: Path
    logical_count: np.ndarray

    def layer_loads(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``(layer_ids [L], counts [L, E], dropped)``: summed over passes, layers that routed
        no token (dense layers) left out and listed in ``dropped``."""
        total = self.logical_count.sum(axis=0)
        busy = total.sum(axis=1) > 0
        ids = np.nonzero(busy)[0].astype(np.int64)
        return ids, total[busy], np.nonzero(~busy)[0].tolist()


def read_sglang_dump(path: Path) -> SglangDump:
    """Load a ``stat`` dump with ``weights_only=True`` and check its layout."""
    path = Path(path)
    if not path.is_file():
        raise SglangDumpError(f"{path} not found")
    what = f"{path} is not an SGLang expert distribution dump"
    # Imported here: torch takes seconds to import, and every other subcommand of the CLI
    # (which imports this module) starts without it.
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SglangDumpError(
            f"{what} that can be loaded safely: torch.load(weights_only=True) refused it "
            f"({first}); only tensors and plain containers are read, never code. Dump it "
            "with SGLang's /dump_expert_distribution_record and "
            "--expert-distribution-recorder-mode stat"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise SglangDumpError(f"{what} (torch.load failed: {err})") from None
    if not isinstance(data, dict):
        raise SglangDumpError(f"{what}: it holds a {type(data).__name__}, not a dict")
    if "records" in data:
        raise SglangDumpError(
            f"{what} of the stat mode: it is a per_token dump (key 'records'); record with "
            "--expert-distribution-recorder-mode stat"
        )
    if "logical_count" not in data:
        raise SglangDumpError(
            f"{what}: no 'logical_count' (keys: {sorted(map(str, data))}); record with "
            "--expert-distribution-recorder-mode stat"
        )
    unknown = set(map(str, data)) - _KNOWN_KEYS
    if unknown:
        raise SglangDumpError(f"{what}: unexpected keys {sorted(unknown)}")
    count = data["logical_count"]
    if not isinstance(count, torch.Tensor):
        raise SglangDumpError(f"{what}: 'logical_count' is a {type(count).__name__}")
    if count.dim() != 3 or count.dtype.is_floating_point or count.dtype == torch.bool:
        raise SglangDumpError(
            f"{what}: 'logical_count' must be an integer tensor [passes, layers, experts], "
            f"got {tuple(count.shape)} {count.dtype}"
        )
    arr = count.to(torch.int64).numpy()
    if arr.size and arr.min() < 0:
        raise SglangDumpError(f"{what}: 'logical_count' holds negative counts")
    return SglangDump(path, arr)


def ingest_sglang_dump(dump: Path, run_dir: Path, step: int) -> tuple[SglangDump, list[int]]:
    """Store a dump's loads (summed over its passes) as step ``step`` of ``run_dir``'s
    rollout store; returns the dump and the layers left out (no tokens)."""
    if not Path(run_dir).is_dir():
        raise SglangDumpError(f"{run_dir} is not a run directory (it does not exist)")
    read = read_sglang_dump(dump)
    ids, counts, dropped = read.layer_loads()
    if not ids.size:
        raise SglangDumpError(f"{dump}: every layer has 0 tokens (the recorder saw no pass)")
    with RolloutLoadRecorder(run_dir) as recorder:
        recorder.record(step, ids, counts)
    return read, dropped
