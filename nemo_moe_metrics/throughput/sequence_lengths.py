"""Real tokens per sequence, and their sums on the device.

The lengths a step trains on come from a ``[batch, seq]`` padding mask
(:func:`lengths_from_attention_mask`) or a packed batch's cumulative offsets
(:func:`lengths_from_cu_seqlens`); :func:`length_sums` adds them up with the attended
(query, key) pairs per attention window, on the lengths' device and without a host-device
synchronisation, for the :class:`~nemo_moe_metrics.throughput.StepMeter` to read at export.
"""

from __future__ import annotations

import torch

from nemo_moe_metrics.flops.core import pairs_per_sequence

#: The longest sequence length accepted (int32's maximum); a longer one is an input error.
MAX_SEQUENCE_LENGTH = 2**31 - 1


def lengths_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens per sequence from a ``[batch, seq]`` padding mask (1/True = real token).

    Stays on the mask's device; no synchronisation. (Megatron's 4-D ``[b, 1, s, s]`` attention
    mask, True = masked, is a different thing: use the padding mask or the packed lengths.)
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected the 2-D "
            "[batch, seq] padding mask (1 = real token), not a 4-D attention mask"
        )
    return attention_mask.to(torch.int64).sum(-1)


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths of a packed batch from its cumulative offsets ``[0, l0, l0+l1, ...]``.

    Pass the unpadded offsets (Megatron's ``cu_seqlens_q``, not ``cu_seqlens_q_padded``), so
    padding is not counted. Stays on device; no synchronisation.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens has shape {tuple(cu_seqlens.shape)}; "
            "expected 1-D offsets [0, l0, l0+l1, ...]"
        )
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)


def length_sums(
    parts: list[torch.Tensor], windows: tuple, causal: bool, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device sums of the lengths: float64 ``[tokens, pairs per window...]`` and int64 check
    ``[negative lengths, min length, lengths over MAX_SEQUENCE_LENGTH, max length]``. Exact
    below 2**53 tokens or attended pairs; no sync."""
    device = parts[0].device if parts else device or torch.device("cpu")
    parts = [p for p in parts if p.numel()]  # a microbatch without sequences adds nothing
    if not parts:
        return (
            torch.zeros(1 + len(windows), dtype=torch.float64, device=device),
            torch.zeros(4, dtype=torch.int64, device=device),
        )
    raw = torch.cat([p.to(device) for p in parts])
    too_long = (raw > MAX_SEQUENCE_LENGTH).sum()
    # Export raises for lengths outside [0, MAX_SEQUENCE_LENGTH]; clamped, the sums below cannot
    # overflow int64 meanwhile (per sequence under 2**62; summed as float64).
    lens = raw.clamp(0, MAX_SEQUENCE_LENGTH)
    cols = [lens.sum().to(torch.float64)]
    for window in windows:
        pairs = pairs_per_sequence(lens, causal=causal, window=window)
        cols.append(pairs.to(torch.float64).sum())
    lens = raw
    check = torch.stack([(lens < 0).sum(), lens.min(), too_long, lens.max()])
    return torch.stack(cols).to(torch.float64), check
