"""The live progress of a run: what each logged step shows, read from ``metrics.jsonl`` as it
grows, and the console it is printed on (whole lines, never cut at 80 columns)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_moe_metrics.export import metric_names as names

# What the live progress bar shows, from the latest JSONL line: (key, label, format).
PROGRESS_FIELDS: list[tuple[str, str, str]] = [
    (names.TRAIN_LOSS, "loss", "{:.4f}"),
    (names.TRAIN_REWARD, "reward", "{:.3f}"),  # GRPO: its on-policy loss is about 0
    (names.TOKENS_PER_SECOND, "tok/s", "{:.0f}"),
    (names.MAX_OVER_IDEAL, "max/ideal", "{:.2f}"),
]


def read_new_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    # Only whole lines: rank 0 may be mid-write when we look.
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:  # not there yet, or unreadable for now: the bar waits
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line (a crash mid-write): the next resume cuts it
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows, offset + end


# GRPO's loss is the clipped policy-gradient surrogate: on-policy its value is about 0 while its
# gradient is not, so the progress line shows the reward first and labels the loss.
GRPO_FIELDS: list[tuple[str, str, str]] = [
    (names.TRAIN_REWARD, "reward", "{:.3f}"),
    (names.TRAIN_LOSS, "pg-loss", "{:.4f}"),
    (names.TOKENS_PER_SECOND, "tok/s", "{:.0f}"),
    (names.MAX_OVER_IDEAL, "max/ideal", "{:.2f}"),
]


GRPO_LOSS_NOTE = (
    "GRPO: reward is what improves; pg-loss is the clipped policy-gradient loss, about 0 "
    "on-policy by construction (its gradient is not 0), so a pg-loss near 0 is expected"
)


# Piped output (a log file, `| tee`): rich assumes 80 columns and would cut the metrics.
PIPED_WIDTH = 160


def describe_step(row: dict[str, Any], algorithm: str | None = None) -> str:
    """The progress line's text for one step's metrics (fields missing from the row are skipped).

    ``algorithm="grpo"`` puts the reward first and labels the loss ``pg-loss`` (see
    :data:`GRPO_LOSS_NOTE`).
    """
    parts = []
    for key, label, fmt in GRPO_FIELDS if algorithm == "grpo" else PROGRESS_FIELDS:
        value = row.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


def make_console(console: Any | None) -> Any:
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal and console.width < PIPED_WIDTH:
        console.width = PIPED_WIDTH  # whole progress lines in a log, never cut at 80 columns
    return console


def say(console: Any, text: str) -> None:
    # soft_wrap: paths and commands stay whole lines, to copy and paste.
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def console_say(console: Any) -> Callable[[str], None]:
    """A function printing one whole line on ``console`` (paths stay whole, to copy)."""
    return lambda text: say(console, text)
