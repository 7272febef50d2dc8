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

The file is read as a ``torch.save`` zip archive only (what SGLang writes), with
``torch.load(weights_only=True, mmap=True)``: tensors and plain containers, nothing else, so a
pickle that carries code is refused before anything in it runs (the error names the global it
asked for); a bare pickle or torch's pre-1.6 format is refused from its opcodes, never
unpickled. Before any count is read, the shape is checked against
:mod:`nemo_moe_metrics.config.limits` (passes, layers, experts) and the tensor must own the storage
its elements need (a view repeating a few bytes with zero strides is not a recorder's buffer);
counts must be in ``0 .. 2**53-1`` and so must their sums over passes (computed in float64
first, so they cannot wrap). Anything but the dict above (``per_token`` dumps, other objects,
other shapes) is refused with the reason, in one line naming the file.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.config.limits import COUNT_BOUND, MAX_COUNT, PASSES, check_shape
from nemo_moe_metrics.run_dir.outputs import check_run_dir
from nemo_moe_metrics.sinks.rollout_store import RolloutLoadRecorder

__all__ = ["SglangDump", "SglangDumpError", "ingest_sglang_dump", "read_sglang_dump"]

_KNOWN_KEYS = {"logical_count", "rank", "average_utilization_rate_over_window"}
_ZIP_MAGIC = b"PK\x03\x04"
# How torch names the global its weights-only unpickler refused (two wordings so far).
_GLOBAL = re.compile(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.<>]+)")
_FIX = (
    "dump it with SGLang's /dump_expert_distribution_record and "
    "--expert-distribution-recorder-mode stat"
)


class SglangDumpError(ValueError):
    """The file is not an SGLang expert distribution dump of the ``stat`` mode."""


@dataclass(frozen=True)
class SglangDump:
    """One dump: its ``logical_count`` shape ``(passes, layers, experts)`` and the counts
    summed over passes, ``counts [layers, experts]`` int64 (each below 2**53)."""

    path: Path
    shape: tuple[int, int, int]
    counts: np.ndarray

    @property
    def total(self) -> int:
        """Every expert-token of the dump, summed exactly (Python integers)."""
        return sum(int(row.sum()) for row in self.counts)

    def layer_loads(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``(layer_ids [L], counts [L, E], dropped)``: summed over passes, layers that routed
        no token (dense layers) left out and listed in ``dropped``."""
        busy = (self.counts > 0).any(axis=1)
        ids = np.nonzero(busy)[0].astype(np.int64)
        return ids, self.counts[busy], np.nonzero(~busy)[0].tolist()


def _first_global(path: Path) -> str | None:
    """The first global a pickle names (read from its opcodes, never executed); None if none."""
    strings: list[str] = []
    with path.open("rb") as f:
        try:
            for op, arg, _ in pickletools.genops(f):
                if op.name in ("GLOBAL", "INST"):
                    return str(arg).replace(" ", ".")
                if op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    return f"{strings[-2]}.{strings[-1]}"
                if isinstance(arg, str):
                    strings.append(arg)
                if op.name == "STOP":
                    return None
        except (ValueError, EOFError, UnicodeDecodeError):
            return None
    return None


def _load(path: Path) -> Any:
    """The object a ``torch.save`` zip archive holds, loaded without running code."""
    what = f"{path} is not an SGLang expert distribution dump"
    if not os.path.lexists(path):
        raise SglangDumpError(f"{path} not found; give the .pt file SGLang dumped")
    if path.is_dir():
        raise SglangDumpError(f"{path} is a directory; give the .pt file SGLang dumped in it")
    if not path.is_file():
        raise SglangDumpError(f"{path} is not a regular file; give the .pt file SGLang dumped")
    with path.open("rb") as f:
        head = f.read(8)
    if not head:
        raise SglangDumpError(f"{what}: the file is empty (0 bytes); {_FIX}")
    if not head.startswith(_ZIP_MAGIC):
        if head[:1] == b"\x80":  # a bare pickle or torch's pre-1.6 format: never unpickled
            found = _first_global(path)
            calls = f" (it names the global {found})" if found else ""
            raise SglangDumpError(
                f"{what}: it is a bare pickle or torch's pre-1.6 format{calls}, not the zip "
                f"archive torch.save writes; it was not loaded (a pickle can carry code); {_FIX}"
            )
        raise SglangDumpError(
            f"{what}: it is not a file torch.save writes (it starts with {head!r}, not a zip "
            f"archive); {_FIX}"
        )
    # Imported here: torch takes seconds to import, and every other subcommand of the CLI
    # (which imports this module) starts without it.
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL.search(str(err))
        if found:
            raise SglangDumpError(
                f"{what}: it asks for the global {found.group(1)} (code, not data), so it was "
                f"refused before anything in it ran; only tensors and plain containers are "
                f"read. {_FIX}"
            ) from None
        # Not torch's own words: they advise weights_only=False, which would run the code.
        raise SglangDumpError(
            f"{what}: it holds more than tensors and plain containers, so it was refused "
            f"before anything in it ran; {_FIX}"
        ) from None
    except Exception as err:  # noqa: BLE001  # torch's readers raise many kinds on bad input
        first = str(err).strip().splitlines()[0] if str(err).strip() else "no detail"
        raise SglangDumpError(
            f"{what}: torch.load could not read it ({type(err).__name__}: {first[:200]}); {_FIX}"
        ) from None


def read_sglang_dump(path: Path) -> SglangDump:
    """Load a ``stat`` dump safely, check its layout and bounds, and sum it over passes."""
    path = Path(path)
    what = f"{path} is not an SGLang expert distribution dump"
    data = _load(path)
    import torch

    if not isinstance(data, dict):
        raise SglangDumpError(f"{what}: it holds a {type(data).__name__}, not a dict")
    if "records" in data:
        raise SglangDumpError(
            f"{what} of the stat mode: it is a per_token dump (key 'records'); record with "
            "--expert-distribution-recorder-mode stat"
        )
    if "logical_count" not in data:
        keys = sorted(map(str, data))
        shown = keys[:10] + (["..."] if len(keys) > 10 else [])
        raise SglangDumpError(
            f"{what}: no 'logical_count' (keys: {shown}); record with "
            "--expert-distribution-recorder-mode stat"
        )
    unknown = sorted(set(map(str, data)) - _KNOWN_KEYS)
    if unknown:
        raise SglangDumpError(f"{what}: unexpected keys {unknown[:10]}")
    count = data["logical_count"]
    if not isinstance(count, torch.Tensor):
        raise SglangDumpError(f"{what}: 'logical_count' is a {type(count).__name__}")
    if count.dim() != 3 or count.dtype.is_floating_point or count.dtype == torch.bool:
        raise SglangDumpError(
            f"{what}: 'logical_count' must be an integer tensor [passes, layers, experts], "
            f"got {tuple(count.shape)} {count.dtype}"
        )
    passes, layers, experts = (int(n) for n in count.shape)
    where = f"{path}: 'logical_count' [{passes}, {layers}, {experts}]"
    PASSES.check(passes, where, "dump a shorter window")
    check_shape(layers, experts, where, "check that the file is SGLang's dump of this model")
    needed = count.numel() * count.element_size()
    if count.numel() and count.untyped_storage().nbytes() < needed:
        raise SglangDumpError(
            f"{what}: 'logical_count' [{passes}, {layers}, {experts}] repeats "
            f"{count.untyped_storage().nbytes():,} bytes of storage (strides "
            f"{tuple(count.stride())}), not the {needed:,} a recorder's buffer of that shape "
            f"holds; {_FIX}"
        )
    if count.numel():
        low, high = int(count.min()), int(count.max())
        if low < 0 or high > MAX_COUNT:
            p, la, e = (int(i) for i in torch.nonzero((count < 0) | (count > MAX_COUNT))[0])
            raise SglangDumpError(
                f"{what}: 'logical_count' holds {int(count[p, la, e]):,} tokens at pass {p}, "
                f"layer {la}, expert {e}; a count is in 0..2**53-1"
            )
    floats = count.sum(dim=0, dtype=torch.float64)
    if floats.numel() and float(floats.max()) >= COUNT_BOUND:
        la, e = (int(i) for i in torch.nonzero(floats >= COUNT_BOUND)[0])
        raise SglangDumpError(
            f"{path}: layer {la} expert {e} sums to {float(floats[la, e]):.3e} tokens over the "
            f"{passes} passes, above the 2**53 a stored count may hold; dump a shorter window"
        )
    layer_sums = floats.sum(dim=1)
    if layer_sums.numel() and float(layer_sums.max()) >= COUNT_BOUND:
        la = int(torch.argmax(layer_sums))
        raise SglangDumpError(
            f"{path}: layer {la}'s counts sum to {float(layer_sums[la]):.3e} tokens over the "
            f"{passes} passes, above the 2**53 a stored step may hold; dump a shorter window"
        )
    counts = count.sum(dim=0, dtype=torch.int64).numpy()  # exact: every sum is below 2**53
    return SglangDump(path, (passes, layers, experts), counts)


def ingest_sglang_dump(dump: Path, run_dir: Path, step: int) -> tuple[SglangDump, list[int]]:
    """Store a dump's loads (summed over its passes) as step ``step`` of ``run_dir``'s
    rollout store; returns the dump and the layers left out (no tokens). ``run_dir`` must be
    a run directory, or a new path or empty directory that becomes one
    (:func:`~nemo_moe_metrics.run_dir.outputs.check_run_dir`): nothing is written elsewhere."""
    read = read_sglang_dump(dump)
    ids, counts, dropped = read.layer_loads()
    if not ids.size:
        raise SglangDumpError(f"{dump}: every layer has 0 tokens (the recorder saw no pass)")
    run_dir = check_run_dir(run_dir, option="--run", create=True)
    with RolloutLoadRecorder(run_dir) as recorder:
        recorder.record(step, ids, counts)
    return read, dropped
