"""``python -m nemo_moe_metrics.cli``: the ``nemo-moe-metrics`` command."""

import sys

from nemo_moe_metrics.cli.command import main

sys.exit(main())
