"""The ``nemo-moe-metrics`` command, the top of the package (nothing imports it back).

- :mod:`.command`: the parser, ``main`` and the subcommands ``check``, ``run``, ``report`` and
  ``flops`` (each importing what it runs when it runs, so ``--help`` and ``check`` start
  without torch);
- :mod:`.placement`: ``placement`` and ``ingest`` (their options, what they print and write).

``python -m nemo_moe_metrics.cli`` is the command too.
"""

from __future__ import annotations

from nemo_moe_metrics.cli.command import add_run_dir_flags, build_parser, main

__all__ = ["add_run_dir_flags", "build_parser", "main"]
