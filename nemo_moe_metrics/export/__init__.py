"""What a step's export is made of, below every metric family.

- :mod:`.metric_names`: every metric key the package emits (the contract dashboards rely on);
- :mod:`.expert_table`: the ``moe/expert_loads`` table of one step as one array value;
- :mod:`.host_read`: the one device-to-host read of an export, and the one collective-device
  rule.

Importing this package imports none of them (``host_read`` imports torch; the names and the
table do not).
"""
