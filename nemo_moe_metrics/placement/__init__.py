"""From measurement to decision: expert placement from a run's stored loads.

- ``eplb``: DeepSeek's expert-parallel load balancer, in numpy (pure functions);
- ``plan``: GPU loads, balancedness, today's contiguous placement, plans and sweeps;
- ``loads``: a run's loads over a window of steps (training or rollout);
- ``engines``: the files SGLang and vLLM read;
- ``sglang_dump``: SGLang's expert distribution recorder dumps, read safely;
- the commands ``nemo-moe-metrics placement`` and ``nemo-moe-metrics ingest``: in
  :mod:`nemo_moe_metrics.cli.placement`, above the report that draws the sweep.
"""
