"""How the per-rank entrypoint gets its arguments when no shell reads its command line.

nemo-run's torchrun component shell-quotes every argument, which is right in an sbatch script
(a shell reads it) and wrong for the local executor (torchrun is started with a list, so the
quotes would stay in the text: ``'policy.model.moe_layer_freq=[0,1,1,1]'`` would reach the
ranks with its quotes). A local launch therefore puts the arguments, as a JSON list, in the
environment variable :data:`ARGV_ENV` and passes only the flag :data:`ARGV_FROM_ENV`, whose
text quoting leaves alone; :func:`rank_argv` turns that back into the list, byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

#: The environment variable holding the ranks' arguments (a JSON list of strings).
ARGV_ENV = "NEMO_MOE_METRICS_TRAIN_ARGV"
#: The one argument a local launch passes: "read the arguments from ARGV_ENV".
ARGV_FROM_ENV = "--argv-from-env"


def rank_argv(argv: list[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """``argv`` as given, or the list in :data:`ARGV_ENV` when ``argv`` is the flag
    :data:`ARGV_FROM_ENV`; ValueError when that variable is missing or not a list of strings."""
    if argv != [ARGV_FROM_ENV]:
        return list(argv)
    raw = environ.get(ARGV_ENV)
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ValueError(
            f"{ARGV_FROM_ENV}: the environment variable {ARGV_ENV} should hold the arguments as "
            f"a JSON list of strings, found {raw!r}; start the ranks with nemo-moe-metrics run"
        )
    return value


__all__ = ["ARGV_ENV", "ARGV_FROM_ENV", "rank_argv"]
