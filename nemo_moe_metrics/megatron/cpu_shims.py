"""Make real megatron-core modules run on a CPU-only machine (tests and the CPU demo).

megatron-core 0.16 assumes CUDA in a handful of places. Each patch below replaces one such
assumption with its CPU equivalent; nothing is patched when CUDA is available, so the same
code runs unchanged on a GPU cluster. The comment on each patch states the fact behind it,
measured with megatron-core 0.16.1 and torch 2.13 (CPU build, gloo): megatron calls
``torch.cuda.current_device()`` to place router weights, RoPE frequencies and the global memory
buffer; 0.16.1 names ``te_general_gemm`` without Transformer Engine; the pipeline schedules
build tensors with ``device="cuda"`` and p2p communication calls ``torch.cuda.synchronize``;
recomputation saves and restores the CUDA RNG state. The model side of the recipe (allgather
dispatcher, no grouped GEMM, float32, an explicit attention mask) is in
:mod:`nemo_moe_metrics.megatron.model`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_applied = False

# Factory functions the pipeline schedules call with device="cuda" (or an int device).
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "randn",
    "rand",
    "empty_like",
    "zeros_like",
    "ones_like",
)


def cuda_available() -> bool:
    """True when a CUDA device is usable (then no shim is ever applied)."""
    return torch.cuda.is_available()


def apply_cpu_shims() -> bool:
    """Patch megatron-core's CUDA assumptions for CPU; idempotent; returns True if applied."""
    global _applied
    if cuda_available():
        return False
    if _applied:
        return True
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # Router weights, RoPE and the global memory buffer are placed on current_device().
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # p2p communication synchronises the device; nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # 0.16.1 references te_general_gemm without Transformer Engine (NameError otherwise).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Activation recomputation saves and restores the "CUDA" RNG state: use the CPU generator.
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # The CUDA RNG tracker's fork() becomes a no-op.
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _applied = True
    return True


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` with ``device="cuda"`` (or an int device) rewritten to ``"cpu"``."""

    @functools.wraps(factory)
    def on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return on_cpu


_depth = 0
_lock = threading.Lock()
_originals: dict[str, Callable[..., torch.Tensor]] = {}


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Context for megatron-core's microbatch schedules on CPU; a no-op when CUDA is available.

    Inside it, torch's tensor factories turn ``device="cuda"`` into ``"cpu"``. They are
    replaced on the ``torch`` module for the context's duration (nesting counted) rather than
    intercepted by a ``TorchFunctionMode``: a mode runs Python on every torch call of the step,
    which made a CPU step about 8% slower and every op of the metrics' hooks 2.5x dearer.
    """
    global _depth
    if cuda_available():
        yield
        return
    with _lock:
        if _depth == 0:
            for name in _FACTORIES:
                _originals[name] = getattr(torch, name)
                setattr(torch, name, _on_cpu(_originals[name]))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in _FACTORIES:
                    setattr(torch, name, _originals.pop(name))
