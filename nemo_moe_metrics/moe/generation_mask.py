"""Which positions of a generation's forwards are real: none after a sequence's end.

``model.generate`` keeps every sequence of the batch going until the last one ends: a sequence
that emitted its end-of-sequence token is fed padding from then on, and its attention mask
still says 1 there (transformers extends the mask with ones at every decode step). Those
positions are routed like real tokens; counting them as the rollout's load credits the experts
that padding goes to (often the same two), so a long ``max_completion_length`` can dominate the
rollout load. verl had the same class of bug (a final token's phantom route credited to
expert 0).

:class:`EndOfSequence` follows one ``generate`` call's forwards (prefill, then each decode step)
and gives each forward's real positions: its attention mask, minus every completion position
after the sequence's first end-of-sequence token (the end token itself is real: it is part of
the completion, as ``gen_perf/tokens`` counts it). Device ops only; nothing is read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class EndOfSequence:
    """One generation's end-of-sequence state; :meth:`real` for each of its forwards, in order.

    The first forward is the prefill (the prompt, every column of its mask); later ones feed
    the completion (one column each with a cache; every column again without one).
    """

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self._eos: torch.Tensor | None = None
        self._prompt_width: int | None = None
        self._done: torch.Tensor | None = None  # [batch] bool: the end token was fed already

    def real(self, tokens: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[batch * width]`` bool of one forward (``tokens [batch, width]``, the whole
        sequence's ``mask [batch, total]``, 1 = real); None when it has neither (every
        position real, as for any forward without a mask)."""
        if tokens is None or tokens.dim() != 2:
            return None if mask is None else mask[:, -1:].reshape(-1).bool()
        rows, width = tokens.shape
        total = int(mask.shape[1]) if mask is not None else width
        base = (
            mask[:, total - width :].bool()
            if mask is not None
            else torch.ones_like(tokens, dtype=torch.bool)
        )
        if self._prompt_width is None or self._done is None or self._done.shape[0] != rows:
            # The prefill: the prompt, real where its mask says so.
            self._prompt_width = total
            self._done = torch.zeros(rows, dtype=torch.bool, device=tokens.device)
            return base.reshape(-1)
        if self._eos is None or self._eos.device != tokens.device:
            self._eos = torch.tensor(self.eos_token_ids, device=tokens.device)
        start = total - width
        position = torch.arange(start, total, device=tokens.device)
        ended = torch.isin(tokens, self._eos) & (position >= self._prompt_width)
        # Without a cache a forward feeds the sequence from its start: nothing carried over.
        carried = self._done if start > 0 else torch.zeros_like(self._done)
        earlier = ended.to(torch.int64).cumsum(-1) - ended.to(torch.int64)
        after_end = carried.unsqueeze(-1) | (earlier > 0)
        self._done = carried | ended.any(-1)
        return (base & ~after_end).reshape(-1)
