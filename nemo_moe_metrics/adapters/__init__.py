"""Model families: each implements the router contract (``moe.router_spec``) for its routers.

``megatron`` (megatron-core's TopKRouter), ``torchtitan`` (its TokenChoiceTopKRouter and config
facts), ``hf`` (every MoE family transformers ships, with ``hf_health``; the fields transformers'
configs and modules hold: ``flops.hf_fields``),
``facts`` (what a model's config says: experts, layers, expert parallelism) and ``registry``
(which spec reads which router). Nothing here imports a framework at module level.
"""
