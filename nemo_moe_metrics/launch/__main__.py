"""``python -m nemo_moe_metrics.launch RECIPE [k=v ...] [--nproc N] [--output-dir D]``: the
launch process (:func:`nemo_moe_metrics.launch.local.main`)."""

from __future__ import annotations

import sys

from nemo_moe_metrics.launch.local import main

if __name__ == "__main__":
    sys.exit(main())
