"""Synthetic data that ships with the package: no downloads, deterministic per (seed, step, rank).

Token 0 is padding; real tokens are 1..vocab_size-1. Every batch is right-padded to the model's
``seq_length`` with per-sequence lengths, which is what the policy worker trains on.

Tasks (all verifiable without a model):
- SFT, next-token prediction on arithmetic progressions ``a, a+d, a+2d, ...`` (mod the real
  vocabulary) with a random start ``a`` and stride ``d``: the next token follows from the context.
- DPO, preference pairs sharing a progression prompt: chosen continues the progression,
  rejected is random tokens.
- GRPO, copy task: the response should repeat the prompt. Per response token, reward 1 for the
  prompt token at the same position, 0.5 for a different token of the same parity, else 0;
  averaged over the response. Exact copying is the only optimum, and the parity credit gives
  a random policy (about 0.25) reward differences within a group to learn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAD_ID = 0


@dataclass
class SequenceBatch:
    """Right-padded token sequences ``[b, s]`` with their real lengths ``[b]``.

    ``prompt_lengths`` marks where the response starts (0 for SFT: every token is trained on);
    ``extras`` holds per-sequence tensors a loss needs (advantages, reference log-probs), sliced
    along dim 0 together with the tokens when a batch is cut into microbatches.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        b, s = self.tokens.shape
        for name in ("lengths", "prompt_lengths"):
            t = getattr(self, name)
            if t.shape != (b,):
                raise ValueError(f"{name} must have shape ({b},), got {tuple(t.shape)}")
        # Value checks read the tensors on the host: only where that is free (CPU), never as a
        # device synchronisation.
        on_cpu = self.lengths.device.type == "cpu"
        if b and on_cpu and (int(self.lengths.min()) < 1 or int(self.lengths.max()) > s):
            raise ValueError(f"lengths must lie in [1, {s}] (the padded width); fix the batch")
        for name, t in self.extras.items():
            if t.shape[0] != b:
                raise ValueError(f"extras[{name!r}] has {t.shape[0]} rows, expected {b}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> SequenceBatch:
        """Sequences ``start:stop`` (a microbatch), extras included; no re-validation."""
        part = object.__new__(SequenceBatch)
        part.tokens = self.tokens[start:stop]
        part.lengths = self.lengths[start:stop]
        part.prompt_lengths = self.prompt_lengths[start:stop]
        part.extras = {k: v[start:stop] for k, v in self.extras.items()}
        return part

    def padding_mask(self) -> torch.Tensor:
        """``[b, s]`` bool, True at padding positions (megatron-core's convention)."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return positions.unsqueeze(0) >= self.lengths.unsqueeze(1)

    def target_mask(self) -> torch.Tensor:
        """``[b, s-1]`` bool: position t predicts token t+1, trained on when that token is a real
        response token (``prompt_length <= t+1 < length``)."""
        nxt = torch.arange(1, self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
        return (nxt < self.lengths.unsqueeze(1)) & (nxt >= self.prompt_lengths.unsqueeze(1))


def generator(seed: int, step: int, rank: int, stream: int = 0) -> torch.Generator:
    """A CPU generator unique to (seed, step, data-parallel rank, stream); deterministic."""
    g = torch.Generator()
    # Large odd multipliers keep distinct tuples from colliding for any realistic sizes.
    g.manual_seed((seed * 1_000_003 + step * 10_007 + rank * 101 + stream) % (2**63))
    return g


def pad(rows: list[torch.Tensor], width: int, prompt_lengths: list[int]) -> SequenceBatch:
    """Right-pad 1-D token rows to ``width``."""
    tokens = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"sequence of length {len(row)} exceeds seq_length={width}")
        tokens[i, : len(row)] = row
    return SequenceBatch(
        tokens,
        torch.tensor([len(r) for r in rows], dtype=torch.long),
        torch.tensor(prompt_lengths, dtype=torch.long),
    )


def _progression(g: torch.Generator, length: int, vocab_size: int) -> torch.Tensor:
    real = vocab_size - 1
    start = int(torch.randint(0, real, (1,), generator=g))
    stride = int(torch.randint(1, 4, (1,), generator=g))
    return (start + stride * torch.arange(length)) % real + 1


def sft_batch(
    batch_size: int, seq_length: int, min_length: int, vocab_size: int, g: torch.Generator
) -> SequenceBatch:
    """Progressions of random lengths in ``[min_length, seq_length]``, trained on every token."""
    if not 2 <= min_length <= seq_length:
        raise ValueError(
            f"min_seq_length={min_length} must lie in [2, seq_length={seq_length}]; "
            "lower training.min_seq_length"
        )
    lengths = torch.randint(min_length, seq_length + 1, (batch_size,), generator=g)
    rows = [_progression(g, int(n), vocab_size) for n in lengths]
    return pad(rows, seq_length, [0] * batch_size)


def dpo_batch(
    num_pairs: int,
    seq_length: int,
    min_length: int,
    response_length: int,
    vocab_size: int,
    g: torch.Generator,
) -> SequenceBatch:
    """``2 * num_pairs`` sequences ordered chosen, rejected, chosen, rejected, ...

    Both members of a pair share the prompt (a progression) and the response length, so a
    microbatch of even size always holds whole pairs.
    """
    max_prompt = seq_length - response_length
    if max_prompt < 2:
        raise ValueError(
            f"seq_length={seq_length} leaves no room for a prompt before a {response_length}-"
            "token response; raise policy.model.seq_length"
        )
    rows, prompts = [], []
    for _ in range(num_pairs):
        plen = int(torch.randint(min(min_length, max_prompt), max_prompt + 1, (1,), generator=g))
        full = _progression(g, plen + response_length, vocab_size)
        rejected = torch.randint(1, vocab_size, (response_length,), generator=g)
        rows += [full, torch.cat([full[:plen], rejected])]
        prompts += [plen, plen]
    return pad(rows, seq_length, prompts)


def copy_prompts(num_prompts: int, prompt_length: int, vocab_size: int, g: torch.Generator):
    """``[num_prompts, prompt_length]`` random prompts for the copy task."""
    return torch.randint(1, vocab_size, (num_prompts, prompt_length), generator=g)


def copy_reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Per-sequence copy score in [0, 1]: 1 per exact token, 0.5 per same-parity token."""
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"{prompts.shape[0]} prompts but {responses.shape[0]} responses")
    n = min(prompts.shape[1], responses.shape[1])
    if n == 0:
        raise ValueError("empty prompt or response: nothing to score")
    target, got = prompts[:, :n], responses[:, :n]
    exact = (got == target).float()
    parity = ((got - target) % 2 == 0).float()
    return (0.5 * parity + 0.5 * exact).mean(dim=1)
