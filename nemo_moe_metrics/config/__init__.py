"""The recipe and its flags: what a user writes, read strictly and checked before anything runs.

- :mod:`.recipe`: the typed models (metric flags, model, policy, training, algorithms, alerts,
  logger, the whole :class:`Recipe`), YAML loading, dotted overrides;
- :mod:`.strict_model`: their strict base (unknown keys named, with a suggestion:
  :mod:`.key_suggestions`) and the wording of config errors;
- :mod:`.layer_pattern`: the one answer to "which layers are MoE";
- :mod:`.limits`: how large a file or an option may say a thing is;
- :mod:`.preflight`: model x parallel layout x batches x data, checked together before a launch.

The recipe's names are importable from here (``from nemo_moe_metrics.config import
MetricsConfig, LoggerConfig, load_recipe``).
"""

from __future__ import annotations

from nemo_moe_metrics.config.recipe import (
    DEFAULT_TABLE_EVERY,
    AlertsConfig,
    DPOConfig,
    GRPOConfig,
    LoggerConfig,
    MegatronConfig,
    MetricsConfig,
    ModelConfig,
    PolicyConfig,
    RayConfig,
    Recipe,
    TrainingConfig,
    apply_overrides,
    dump_recipe,
    load_recipe,
    recipe_from_dict,
)
from nemo_moe_metrics.config.strict_model import ConfigError, StrictModel, recipe_error_text

__all__ = [
    "DEFAULT_TABLE_EVERY",
    "AlertsConfig",
    "ConfigError",
    "DPOConfig",
    "GRPOConfig",
    "LoggerConfig",
    "MegatronConfig",
    "MetricsConfig",
    "ModelConfig",
    "PolicyConfig",
    "RayConfig",
    "Recipe",
    "StrictModel",
    "TrainingConfig",
    "apply_overrides",
    "dump_recipe",
    "load_recipe",
    "recipe_error_text",
    "recipe_from_dict",
]
