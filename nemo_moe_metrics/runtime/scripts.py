"""What the runnable torchrun scripts (``examples/integrate_*.py``) share before any rank talks.

Started with plain ``python``, a script says that it runs under torchrun and prints the command;
a missing extra is one line, printed by the first rank only, and every rank ends with status 2
at once (no traceback per rank, no rank killed by another's failure first).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nemo_moe_metrics.runtime.extras import missing_extra_message, missing_modules

#: The exit status of a script that cannot start (as the CLI's usage errors).
CANNOT_START = 2


def check_torchrun_script(
    script: str, *, extras: Sequence[tuple[str, str]] = (), nproc: int = 2
) -> None:
    """Exit with :data:`CANNOT_START` and one line when ``script`` cannot run here.

    ``extras``: ``(extra, what needs it)`` pairs that must be installed. Checked before the
    process group starts, so every rank decides alone and alike.
    """
    for extra, what in extras:
        missing = missing_modules(extra)
        if missing:
            _fail(missing_extra_message(missing[0], extra, what))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        args = " ".join(shlex.quote(a) for a in sys.argv[1:])
        _fail(
            f"{script} runs one process per rank under torchrun (RANK and WORLD_SIZE are not "
            f"set); start it with: torchrun --nproc-per-node {nproc} {script} {args}".rstrip()
        )


def _fail(message: str) -> None:
    # Every rank exits; only the first rank speaks. torchrun's failure summary shows what a
    # rank wrote to its error file (its documented JSON "message"), so the rank it names as
    # the root cause shows this line too, not "To enable traceback see ...".
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(
                json.dumps({"message": message, "timestamp": int(time.time())}), encoding="utf-8"
            )
    raise SystemExit(CANNOT_START)
