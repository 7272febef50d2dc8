"""Router forwards kept for one batched pass: the byte budget, and segment ids.

The per-forward hooks (router health, routing consistency, the Hugging Face load-balancing
loss) keep what a forward produced and do their arithmetic once for many forwards: at the
step's end, or sooner when the kept tensors reach :data:`FLUSH_BYTES`. Each device op then
runs once per step instead of once per layer and microbatch (on a CPU, and for a GPU's kernel
launches, the count of ops is the cost at small sizes). Pure tensor arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Bytes of router outputs a tracker keeps before its batched pass: the whole step on small
#: models, a few layers' forwards of a large one.
FLUSH_BYTES = 64 << 20


def segment_ids(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[sum(lengths)]`` int64: for each token of forwards concatenated, its forward's
    position. Fills on the device: no host-to-device copy, whatever the lengths."""
    return torch.cat(
        [torch.full((n,), i, dtype=torch.int64, device=device) for i, n in enumerate(lengths)]
    )
