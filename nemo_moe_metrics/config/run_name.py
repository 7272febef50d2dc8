"""The run's name: the name of its directory under ``--output-dir`` and the prefix of its
tracker runs, checked where the recipe is read (``logger.run_name``, the recipe's ``name``).

Plain text rules, below the run directory that uses the name (:mod:`nemo_moe_metrics.run_dir`).
"""

from __future__ import annotations

import re

#: The longest run name: the name is a directory and a prefix of tracker run names; every file
#: system here takes 255 bytes per component, and the run's own files add their names below.
MAX_RUN_NAME = 100
# POSIX's portable file name characters; the first one neither hides the directory (.) nor
# reads as an option (-).
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def check_run_name(name: str) -> str:
    """``name`` when it can be a run directory's name (one path component of the portable
    characters ``A-Z a-z 0-9 . _ -``, not starting with ``.`` or ``-``, at most
    :data:`MAX_RUN_NAME` characters); else ValueError saying what is wrong and what to do."""
    fix = "give a name such as grpo_moe_tiny_v2 (letters, digits, '.', '_', '-')"
    if not name or name in (".", ".."):
        problem = f"{name!r} names no directory of its own"
    elif "/" in name or "\\" in name:
        problem = f"{name!r} holds a path separator, so the run would leave --output-dir"
    elif len(name) > MAX_RUN_NAME:
        problem = f"{len(name)} characters is longer than the {MAX_RUN_NAME} a run name may have"
    elif not _RUN_NAME.fullmatch(name):
        bad = sorted({c for c in name if not re.fullmatch(r"[A-Za-z0-9._-]", c)})
        problem = (
            f"{name!r} starts with '.' or '-'"
            if not bad
            else f"{name!r} holds {', '.join(repr(c) for c in bad)}, outside the characters "
            "every file system and tracker takes"
        )
    else:
        return name
    raise ValueError(f"{problem}; the name is the run directory's name under --output-dir: {fix}")


__all__ = ["MAX_RUN_NAME", "check_run_name"]
