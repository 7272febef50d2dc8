"""Model families: each implements the router contract (``moe.router_spec``) for its routers.

``megatron`` (megatron-core's TopKRouter), ``torchtitan`` (its TokenChoiceTopKRouter and config
facts), ``hf`` (every MoE family transformers ships, with ``hf_fields`` and ``hf_health``),
``facts`` (what a model's config says: experts, layers, expert parallelism) and ``registry``
(which spec reads which router). Nothing here imports a framework at module level.
"""
