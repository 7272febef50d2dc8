"""Moved to :mod:`nemo_moe_metrics.sinks.alerts` (the alerts run in the sink fan-out).

Kept only until ``launch`` and ``sinks/__init__`` import ``sinks.alerts`` (their owners switch
them); nothing else imports this module. Delete it then.
"""

from nemo_moe_metrics.sinks.alerts import AlertConsole, AlertMonitor

__all__ = ["AlertConsole", "AlertMonitor"]
