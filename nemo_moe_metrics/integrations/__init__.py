"""One thin module per training framework; each imports its framework lazily.

- :mod:`nemo_moe_metrics.integrations.megatron_bridge`: ``MoEMetricsCallback``, a Megatron-Bridge
  training callback (``pretrain(config, forward_step, callbacks=[...])``).
- :mod:`nemo_moe_metrics.integrations.transformers`: ``MoEMetricsCallback``, a
  ``transformers.TrainerCallback`` for the ``Trainer`` and TRL's SFT, DPO and GRPO trainers
  (``callbacks=[...]``; docs/en/trl.md).

Importing this package imports no framework; the core package never imports an integration.
"""
