"""What the hardening tests build and measure: a user's files fingerprinted (sha256), store
records written from the format in ``store_format``'s docstring (not with the store's own
encoder), and the peak memory of one CLI command in a child process of its own."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
#: The most memory a bounded case may take (issue 52): the child's peak resident set.
PEAK_LIMIT_MB = 512

# One command, then its own peak (ru_maxrss is a peak: one child per measured case).
_PEAK = (
    "import resource, sys\n"
    "from nemo_moe_metrics.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc, flush=True)\n"
)


def fingerprint(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (links as ``-> target``, never followed)."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "-> " + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


def cli_peak_mb(*args: str, timeout: float = 120) -> tuple[float, int, str]:
    """Run ``nemo-moe-metrics ARGS`` in a child; ``(peak MB, exit status, stdout+stderr)``.

    The child is forked by a small shell, not by pytest: Linux keeps a process's peak across
    ``execve`` (``ru_maxrss`` of a child forked by pytest starts at pytest's own size), and a
    shell that runs one more command after it must fork rather than exec."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c", _PEAK, *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PEAK_KB")), None)
    assert line is not None, said
    _, kb, rc = line.split()
    return int(kb) / 1024, int(rc), said


def record(
    step: int,
    layer_ids: Iterable[int],
    planes: Iterable[bytes],
    layers: int,
    experts: int,
    itemsize: int,
) -> bytes:
    """One version-2 store record: header, its checksum, zlib(ids, shuffled count planes)."""
    packer = zlib.compressobj(9)
    payload = packer.compress(np.asarray(list(layer_ids), "<i4").tobytes())
    for chunk in planes:
        payload += packer.compress(chunk)
    payload += packer.flush()
    head = struct.pack(
        "<4sQIIBBHII", b"ELR2", step, layers, experts, itemsize, 1, 0, len(payload),
        zlib.crc32(payload),
    )  # fmt: skip
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def wide_record(step: int, counts: np.ndarray, layer_ids: Iterable[int] | None = None) -> bytes:
    """A record of 8-byte counts ``[L, E]`` (any uint64 value, as a foreign writer may)."""
    arr = np.asarray(counts, dtype="<u8")
    planes = np.ascontiguousarray(arr.reshape(-1).view(np.uint8).reshape(-1, 8).T)
    ids = range(arr.shape[0]) if layer_ids is None else layer_ids
    return record(step, ids, [planes.tobytes()], arr.shape[0], arr.shape[1], 8)


def square_zero_record(step: int, n: int) -> bytes:
    """An honest record declaring an ``n x n`` table of zeros (1-byte counts): small on disk,
    ``8 n**2`` bytes once decoded into int64."""
    zero = b"\0" * (1 << 20)
    return record(step, range(n), (zero for _ in range((n * n) >> 20)), n, n, 1)
