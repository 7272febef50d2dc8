"""Old import path of the collector and ``register_router`` (kept for users' code).

The collector is ``nemo_moe_metrics.moe.collector``; router specs are ``moe.router_spec``;
``register_router`` lives in ``nemo_moe_metrics.adapters.registry`` (also
``nemo_moe_metrics.register_router``).
"""

from nemo_moe_metrics.adapters.registry import register_router
from nemo_moe_metrics.moe.collector import ExpertLoadCollector
from nemo_moe_metrics.moe.router_spec import RouterSpec, layer_id_from_name

__all__ = ["ExpertLoadCollector", "RouterSpec", "layer_id_from_name", "register_router"]
