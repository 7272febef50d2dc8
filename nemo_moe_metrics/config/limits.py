"""How large a file or an option may say a thing is, checked before anything is allocated.

A store record, an SGLang dump or a command-line option declares sizes (layers, experts,
passes, redundant experts, a sweep's range); a few bytes can declare terabytes. Each size is
checked against a limit drawn from the real workloads the docs name (a 94-layer x 256-expert
model, SGLang's 1,000-pass buffer, DeepSeek-V3 serving 256 experts with 32 redundant ones),
with room to spare; an error names the limit, why it is that, and the environment variable
that raises it (:class:`Limit`). Counts and step numbers have a fixed bound instead
(:data:`MAX_COUNT`, :data:`MAX_STEP`): what a float64 and JSON hold exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

#: Tokens per expert of one step (or one SGLang pass, or summed over passes), and any step
#: number, stay below 2**53: JSON readers and float64 hold every integer below it exactly.
COUNT_BOUND = 1 << 53
MAX_COUNT = COUNT_BOUND - 1
MAX_STEP = COUNT_BOUND - 1
#: A sum of counts (a layer over a window of steps) is checked to stay below this, so that
#: adding one more block of steps (each below 64 x 2**53 = 2**59) cannot pass 2**63.
SUM_BOUND = 1 << 62


class LimitError(ValueError):
    """A declared size above its :class:`Limit`; the message names the limit and how to
    raise it."""


@dataclass(frozen=True)
class Limit:
    """One named bound: ``default`` unless the environment variable ``env`` says otherwise."""

    what: str  # "MoE layers of one step"
    default: int
    env: str
    why: str  # the real workload it was drawn from

    @property
    def value(self) -> int:
        """The limit in force (``env`` when it holds a whole number >= 1, else the default)."""
        raw = os.environ.get(self.env, "").strip()
        return int(raw) if raw.isdigit() and int(raw) >= 1 else self.default

    def check(self, n: int, where: str, fix: str) -> None:
        """Raise :class:`LimitError` when ``n`` is above the limit: ``where`` names the file or
        option that declared ``n``, ``fix`` what the user may change instead."""
        if n > self.value:
            raise LimitError(
                f"{where}: {n:,} {self.what} is above the limit of {self.value:,} ({self.why}); "
                f"{fix}, or raise the limit with {self.env}=N"
            )


LAYERS = Limit(
    "MoE layers", 1024, "NEMO_MOE_METRICS_MAX_LAYERS", "the largest model the docs name has 94"
)
EXPERTS = Limit(
    "experts per layer", 4096, "NEMO_MOE_METRICS_MAX_EXPERTS", "DeepSeek-V3 has 256, the most 512"
)
CELLS = Limit(
    "layer x expert cells of one step",
    1 << 18,
    "NEMO_MOE_METRICS_MAX_CELLS",
    "94 x 256 = 24,064 in the largest model the docs name",
)
PASSES = Limit(
    "recorded passes",
    100_000,
    "NEMO_MOE_METRICS_MAX_PASSES",
    "SGLang's recorder keeps 1,000 by default",
)
REDUNDANCY = Limit(
    "redundant experts per logical expert",
    2,
    "NEMO_MOE_METRICS_MAX_REDUNDANCY",
    "DeepSeek-V3 serves 256 experts with 32 redundant ones, 1/8 per expert",
)
PER_GPU = Limit(
    "redundant experts per GPU",
    64,
    "NEMO_MOE_METRICS_MAX_REDUNDANT_PER_GPU",
    "a plan computes one EPLB placement per redundant expert per GPU; DeepSeek-V3 serves 1",
)

#: Every limit, for the docs and the tests.
LIMITS = (LAYERS, EXPERTS, CELLS, PASSES, REDUNDANCY, PER_GPU)


def check_shape(layers: int, experts: int, where: str, fix: str) -> None:
    """Layers, experts and their product against :data:`LAYERS`, :data:`EXPERTS`, :data:`CELLS`."""
    LAYERS.check(layers, where, fix)
    EXPERTS.check(experts, where, fix)
    CELLS.check(layers * experts, where, fix)


def check_step(step: int, where: str) -> None:
    """A step number: a whole number in ``0 .. MAX_STEP``; ValueError naming ``where``."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise ValueError(f"{where}: a step is a whole number, got {step!r}")
    if not 0 <= int(step) <= MAX_STEP:
        raise ValueError(
            f"{where}: step {int(step):,} is outside 0..2**53-1 (a step number is a count of "
            "training steps, never negative; JSON readers hold no larger integer exactly)"
        )


def first_over(counts: np.ndarray, bound: int = MAX_COUNT) -> tuple[int, ...] | None:
    """The index of the first count of ``counts`` above ``bound`` or below 0, else None."""
    if not counts.size:
        return None
    bad = (counts < 0) | (counts > bound)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0])


__all__ = [
    "CELLS",
    "COUNT_BOUND",
    "EXPERTS",
    "LAYERS",
    "LIMITS",
    "MAX_COUNT",
    "MAX_STEP",
    "PASSES",
    "PER_GPU",
    "REDUNDANCY",
    "SUM_BOUND",
    "Limit",
    "LimitError",
    "check_shape",
    "check_step",
    "first_over",
]
