"""Old import path of :class:`~nemo_moe_metrics.metrics.PolicyMetrics` (kept for users' code).

``PolicyMetrics`` lives in ``nemo_moe_metrics.metrics`` (also ``nemo_moe_metrics.PolicyMetrics``);
``ModelFacts`` in ``nemo_moe_metrics.adapters.family``, ``model_facts`` in
``nemo_moe_metrics.adapters.registry``.
"""

from nemo_moe_metrics.adapters.family import ModelFacts
from nemo_moe_metrics.adapters.registry import model_facts
from nemo_moe_metrics.metrics import PolicyMetrics

__all__ = ["ModelFacts", "PolicyMetrics", "model_facts"]
