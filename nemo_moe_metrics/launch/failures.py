"""What a failed job left behind, and which rank failed first.

The failing rank's own first error is what ``nemo-moe-metrics run`` shows, not the errors it
caused on the others ("Connection closed by peer"): torchrun's summary names the failure it
observed first (:func:`torchrun_root_cause`; a rank killed by a signal has a negative exit
code), each rank writes its own first error to a small file outside the run directory
(:func:`record_failure`: readable when the run directory's disk is full and the rank logs
were cut), and the rank logs are parsed last (:func:`first_rank_failure`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

#: Set by ``nemo-moe-metrics run`` for its ranks: the file each rank appends its first error to.
LAST_WORDS_ENV = "NEMO_MOE_METRICS_LAST_WORDS"


# torchrun prefixes rank output with "[defaultN]:", torch.distributed's own with "[rankN]: ".
# torchrun prefixes rank output with "[defaultN]:", torch.distributed's own with "[rankN]: ";
# srun --label (one Slurm task per rank) with "N: ".
_RANK_PREFIX = re.compile(r"^(?:\[default(\d+)\]:|\s*(\d+): )(?:\[rank\d+\]: ?)?")
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (.+)$')
_CHAIN = ("The above exception was the direct cause", "During handling of the above exception")


@dataclass
class RankFailure:
    """The first exception found in a torchrun log: which rank, what, and where."""

    rank: int
    exception: str  # "Type: message" (the message may span lines)
    frame: str | None  # deepest frame in this package or the user's code: "path:line in func"
    raised_at: str | None  # deepest frame overall, when it is elsewhere (torch, megatron, ...)
    refused: bool = False  # the rank refused its command line (nothing was raised in training)
    died: bool = False  # the rank's process ended without an exception (a Ray actor's death)

    def describe(self) -> str:
        """A few lines for the terminal."""
        if self.refused:
            return f"rank {self.rank} refused its arguments: {self.exception}"
        if self.died:
            return f"rank {self.rank} {self.exception}"
        lines = [f"rank {self.rank} raised {self.exception}"]
        if self.frame:
            lines.append(f"  at {self.frame}")
        if self.raised_at and self.raised_at != self.frame:
            lines.append(f"  raised in {self.raised_at}")
        return "\n".join(lines)


def _short_path(path: str) -> str:
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _is_own_or_user_code(path: str) -> bool:
    if path.startswith("<"):
        return False
    if "/nemo_moe_metrics/" in path:
        return True
    return (
        "/site-packages/" not in path
        and "/dist-packages/" not in path
        and "/lib/python" not in path
    )


def first_rank_failure(log: Path, rank: int | None = None) -> RankFailure | None:
    """Parse a torchrun ``combined.log``: the earliest rank traceback (of ``rank`` when given),
    its exception and frames."""
    per_rank: dict[int, list[str]] = {}
    first_rank: int | None = None
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        m = _RANK_PREFIX.match(raw)
        if not m:
            continue
        r, line = int(m[1] or m[2]), raw[m.end() :]
        per_rank.setdefault(r, []).append(line)
        if (
            first_rank is None
            and rank in (None, r)
            and line.startswith("Traceback (most recent call last):")
        ):
            first_rank = r
    if first_rank is None:
        return None
    lines = per_rank[first_rank]
    start = next(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent"))
    frames: list[tuple[str, int, str]] = []
    exception: list[str] = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("Traceback (most recent"):
            frames, exception = [], []  # a chained exception: the last one is what failed
        elif not exception:
            m = _FRAME.match(line)
            if m:
                frames.append((m[1], int(m[2]), m[3]))
            elif line.strip() and not line.startswith(" "):
                exception.append(line)  # source lines and caret markers are indented
        elif not line.strip() or line.startswith(_CHAIN):
            # The message ended; go on only when a chained traceback follows.
            if not any(x.startswith("Traceback (most recent") for x in lines[i : i + 4]):
                break
        else:
            exception.append(line)
    if not exception:
        return None
    frame, raised_at = _frames_text(frames)
    return RankFailure(first_rank, "\n".join(exception[:20]), frame, raised_at)


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):(.*?)(?:={10,}|\Z)", re.S)


def torchrun_root_cause(log: Path) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the failure torchrun observed first (a negative exit code is a
    signal: -9 for SIGKILL), from the summary it prints when its job fails; None without one."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    m = _ROOT_CAUSE.search(text)
    if not m:
        return None
    rank = re.search(r"\brank\s*:\s*(\d+)", m[1])
    code = re.search(r"\bexitcode\s*:\s*(-?\d+)", m[1])
    if not (rank and code):
        return None
    return int(rank[1]), int(code[1])


def _frames_text(frames: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    own = [f for f in frames if _is_own_or_user_code(f[0])]
    fmt = lambda f: f"{_short_path(f[0])}:{f[1]} in {f[2]}"  # noqa: E731
    return (fmt(own[-1]) if own else None), (fmt(frames[-1]) if frames else None)


def frame_summary(frames: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    """``(deepest frame in this package or the user's code, deepest frame overall)`` of a
    traceback's ``(file, line, function)`` frames, each as ``"path:line in func"``."""
    return _frames_text(frames)


def record_failure(err: BaseException, rank: int | None = None) -> None:
    """Append this rank's error to the file :data:`LAST_WORDS_ENV` names (when it is set):
    one JSON line with the rank, the time, ``Type: message`` and where it was raised."""
    path = os.environ.get(LAST_WORDS_ENV)
    if not path or isinstance(err, SystemExit | KeyboardInterrupt):
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(err.__traceback__)]
    frame, raised_at = _frames_text(frames)
    line = {
        "rank": rank,
        "time": time.time(),
        "exception": f"{type(err).__name__}: {err}"[:4000],
        "frame": frame,
        "raised_at": raised_at,
    }
    _append_line(path, line)


def record_rank_failure(failure: RankFailure) -> None:
    """Record (as :func:`record_failure`) a rank's failure that another process observed: a
    Ray driver's, for an actor that raised or died (``failure.exception`` says how)."""
    path = os.environ.get(LAST_WORDS_ENV)
    if not path:
        return
    line = {
        "rank": failure.rank,
        "time": time.time(),
        "exception": failure.exception[:4000],
        "frame": failure.frame,
        "raised_at": failure.raised_at,
        "died": failure.died,
    }
    _append_line(path, line)


def record_refusal(message: str, argv: list[str]) -> None:
    """Record (as :func:`record_failure`) that this rank refused its command line ``argv``
    with ``message``: the launcher then says so, with the arguments as the rank got them."""
    path = os.environ.get(LAST_WORDS_ENV)
    if not path:
        return
    line = {
        "rank": int(os.environ.get("RANK", "0")),
        "time": time.time(),
        "exception": f"{message}\n  the rank's arguments, as it got them: {argv!r}"[:4000],
        "refused": True,
    }
    _append_line(path, line)


def _append_line(path: str, line: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)


def read_failures(path: Path | None) -> list[RankFailure]:
    """The errors ranks recorded with :func:`record_failure`, earliest first."""
    if path is None:
        return []
    rows = []
    with contextlib.suppress(OSError):
        for raw in Path(path).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                row = json.loads(raw)
                rows.append((float(row["time"]), RankFailure(
                    int(row["rank"]), str(row["exception"]), row.get("frame"),
                    row.get("raised_at"), bool(row.get("refused")), bool(row.get("died")),
                )))  # fmt: skip
    return [f for _, f in sorted(rows, key=lambda r: r[0])]


def rank_failure_lines(log: Path | None, recorded: list[RankFailure]) -> list[str]:
    """The lines saying which rank failed first and how (see the module docstring)."""
    root = torchrun_root_cause(log) if log is not None else None
    if root is not None and root[1] < 0:
        return _killed_lines(root[0], -root[1], log, recorded)
    if recorded:  # exact times: the earliest error is the cause, later ones its consequences
        return [recorded[0].describe()]
    if log is None:
        return []
    wanted = root[0] if root is not None else None
    failure = first_rank_failure(log, rank=wanted) or first_rank_failure(log)
    if failure:
        return [failure.describe()]
    return ["no Python exception in the rank log (killed by a signal or out of memory?)"]


def torchelastic_last_words(home: Path, since: float = 0.0, lines: int = 2) -> list[str]:
    """The ranks' last lines in torchelastic's own per-rank logs under ``home`` (nemo-run's
    folder of the run), written since ``since``: what the ranks said after torchrun itself
    died, when nothing read their output any more."""
    found = []
    for log in sorted(Path(home).glob("**/torchelastic/**/attempt_*/*/stderr.log")):
        try:
            if log.stat().st_mtime < since:
                continue
            text = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        said = [line.strip() for line in text if line.strip()][-lines:]
        rank = f"rank {log.parent.name}: "
        found += [line if line.startswith(rank) else rank + line for line in said]
    return found


def launcher_death_lines(last_words: list[str]) -> list[str]:
    """What to say when the ranks' last words show that torchrun ended before them."""
    if not any("parent process" in line and "has ended" in line for line in last_words):
        return []
    return [
        "torchrun, which started and watched the ranks, ended before them (killed, e.g. "
        "kill -9, or crashed); the ranks then stopped. Their last words (torchelastic's log):",
        *(f"  {line}" for line in last_words),
    ]


def _killed_lines(rank: int, sig: int, log: Path | None, recorded: list[RankFailure]) -> list[str]:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    out = [
        f"rank {rank} was killed by {name} (signal {sig}) without a Python error: the "
        "out-of-memory killer, a kill -9, or the cluster stopped it"
    ]
    after = recorded[0] if recorded else (first_rank_failure(log) if log is not None else None)
    if after is not None and after.rank != rank:
        first = after.exception.splitlines()[0]
        out.append(f"  then rank {after.rank} failed because of it: {first}")
    return out
