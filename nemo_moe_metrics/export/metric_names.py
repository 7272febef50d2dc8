"""The metric-name contract: every key the package emits, in one place.

Users' dashboards depend on these names; keep them stable. Code builds keys only through the
helpers below, and the docs test checks that every key here is in docs/en and docs/zh.
Algorithms log keys exactly as returned: one ``moe/`` prefix, never a second.
"""

from __future__ import annotations

MOE_PREFIX = "moe/"
PERF_PREFIX = "train_perf/"

# megatron-core load-balancing type -> the name its router records in the aux-loss tracker.
AUX_LOSS_TRACKER_NAMES: dict[str, str] = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
Z_LOSS = "z_loss"
# A Hugging Face model's load-balancing loss over its real tokens only (transformers' function
# given the attention mask, per layer); moe/load_balancing_loss keeps the padding, as the model's
# function without a mask computes it.
REAL_TOKENS_LOSS = "load_balancing_loss_real_tokens"


def aux_loss_key(name: str) -> str:
    """``moe/load_balancing_loss``: the loss averaged over MoE layers."""
    return f"{MOE_PREFIX}{name}"


def aux_loss_layer_key(name: str, layer: int) -> str:
    """``moe/load_balancing_loss_layer_{i}``, ``i`` the global layer index (0-based)."""
    return f"{MOE_PREFIX}{name}_layer_{layer}"


# megatron-core's overload factor (its dev branch, log_moe_overload_factor), from our counts:
# the busiest TP x EP rank's tokens over the balanced count per microbatch (moe/overload.py).
AVG_OVERLOAD_FACTOR = "moe/avg_overload_factor"
MAX_OVERLOAD_FACTOR = "moe/max_overload_factor"
MAX_CUM_OVERLOAD_FACTOR = "moe/max_cum_overload_factor"
OVERLOAD_KEYS = (AVG_OVERLOAD_FACTOR, MAX_OVERLOAD_FACTOR, MAX_CUM_OVERLOAD_FACTOR)


def overload_layer_key(kind: str, layer: int) -> str:
    """``moe/avg_overload_factor_layer_{i}`` (``kind`` avg) or ``moe/max_..._layer_{i}``."""
    return f"{MOE_PREFIX}{kind}_overload_factor_layer_{layer}"


# Expert-load balance summaries over MoE layers.
MAX_OVER_IDEAL = "moe/max_over_ideal"
MAX_OVER_IDEAL_MAX = "moe/max_over_ideal_max"
EP_IMBALANCE = "moe/ep_imbalance"
EP_IMBALANCE_MAX = "moe/ep_imbalance_max"
DEAD_EXPERTS = "moe/dead_experts"
DROPPED_FRACTION = "moe/dropped_fraction"
PADDING_FRACTION = "moe/padding_fraction"
# Share of the top-k picks that went to zero-computation experts (longcat_flash, zaya), over all
# MoE layers; logged only for models that have such experts (per layer: ZERO_EXPERT_STAT).
ZERO_EXPERT_FRACTION = "moe/zero_expert_fraction"
ZERO_EXPERT_STAT = "zero_expert_fraction"
# Training tokens the MoE routers saw this step (the busiest MoE layer's count); 0 means no expert
# received a training token: then no other balance key and no aux loss is logged for the step.
ROUTED_TOKENS = "moe/routed_tokens"
# Percentiles over the MoE layers' global max/ideal (numpy's default linear percentile) and the
# global id of the layer with the highest one: a fixed set whatever the model size.
MAX_OVER_IDEAL_P50 = "moe/max_over_ideal_p50"
MAX_OVER_IDEAL_P90 = "moe/max_over_ideal_p90"
WORST_LAYER = "moe/worst_layer"
# Threshold crossings of this step (logger.alerts); logged every step while alerts are enabled.
ALERTS = "moe/alerts"

# Per-layer balance statistics, logged as moe/layer_{i}/{stat} with moe_per_layer_logging.
LAYER_STATS = (
    "max_over_ideal",
    "min_over_ideal",
    "coefficient_of_variation",
    "normalized_entropy",
    "zero_token_experts",
    "ep_imbalance",
    "dropped_fraction",
    "padding_fraction",
)
# Logged only where they apply (layers with zero-computation experts).
OPTIONAL_LAYER_STATS = (ZERO_EXPERT_STAT,)


def layer_stat_key(layer: int, stat: str) -> str:
    """``moe/layer_{i}/{stat}`` for one MoE layer (``i`` global, 0-based)."""
    if stat not in LAYER_STATS + OPTIONAL_LAYER_STATS:
        known = LAYER_STATS + OPTIONAL_LAYER_STATS
        raise KeyError(f"unknown per-layer statistic {stat!r}; known: {known}")
    return f"{MOE_PREFIX}layer_{layer}/{stat}"


# Aux-loss-free balancing (routers with an expert bias): means over MoE layers with a bias, and
# per layer moe/layer_{i}/{stat} with moe_per_layer_logging (moe/expert_bias.py).
EXPERT_BIAS_RANGE = "moe/expert_bias_range"
EXPERT_BIAS_UPDATE = "moe/expert_bias_update"
EXPERT_BIAS_KEYS = (EXPERT_BIAS_RANGE, EXPERT_BIAS_UPDATE)
BIAS_LAYER_STATS = ("expert_bias_range", "expert_bias_update")


def expert_bias_layer_key(layer: int, stat: str) -> str:
    """``moe/layer_{i}/expert_bias_range`` or ``.../expert_bias_update`` (``i`` global, 0-based)."""
    if stat not in BIAS_LAYER_STATS:
        raise KeyError(f"unknown expert-bias statistic {stat!r}; known: {BIAS_LAYER_STATS}")
    return f"{MOE_PREFIX}layer_{layer}/{stat}"


# Router decision health (track_router_health, moe/router_health.py): summaries over the MoE
# layers, always the same small set; per layer moe/layer_{i}/{stat} with moe_per_layer_logging.
ROUTER_CONFIDENCE = "moe/router_confidence"
ROUTER_CONFIDENCE_MIN = "moe/router_confidence_min"
ROUTER_ENTROPY = "moe/router_entropy"
ROUTER_TOPK_RELATIVE_GAP = "moe/router_topk_relative_gap"
ROUTER_NEAR_TIE_FRACTION = "moe/router_near_tie_fraction"
ROUTER_NEAR_TIE_FRACTION_MAX = "moe/router_near_tie_fraction_max"
ROUTER_LOGIT_MAX_ABS = "moe/router_logit_max_abs"
ROUTER_LOGIT_RMS = "moe/router_logit_rms"
EXPERT_BIAS_TOPK_OVERLAP = "moe/expert_bias_topk_overlap"  # routers with an expert bias
MAX_OVER_IDEAL_MICROBATCH = "moe/max_over_ideal_microbatch"
ROLLOUT_MAX_OVER_IDEAL = "moe/rollout_max_over_ideal"  # with rollout routes
ROUTER_HEALTH_KEYS = (
    ROUTER_CONFIDENCE,
    ROUTER_CONFIDENCE_MIN,
    ROUTER_ENTROPY,
    ROUTER_TOPK_RELATIVE_GAP,
    ROUTER_NEAR_TIE_FRACTION,
    ROUTER_NEAR_TIE_FRACTION_MAX,
    ROUTER_LOGIT_MAX_ABS,
    ROUTER_LOGIT_RMS,
    EXPERT_BIAS_TOPK_OVERLAP,
    MAX_OVER_IDEAL_MICROBATCH,
    ROLLOUT_MAX_OVER_IDEAL,
)
ROUTER_HEALTH_LAYER_STATS = (
    "router_confidence",
    "router_entropy",
    "router_topk_relative_gap",
    "router_near_tie_fraction",
    "router_logit_max_abs",
    "router_logit_rms",
    "expert_bias_topk_overlap",
    "max_over_ideal_microbatch",
    "rollout_max_over_ideal",
)


def router_health_layer_key(layer: int, stat: str) -> str:
    """``moe/layer_{i}/router_confidence`` and the other router-health statistics of one layer."""
    if stat not in ROUTER_HEALTH_LAYER_STATS:
        raise KeyError(
            f"unknown router-health statistic {stat!r}; known: {ROUTER_HEALTH_LAYER_STATS}"
        )
    return f"{MOE_PREFIX}layer_{layer}/{stat}"


# The expert-load table: a list of rows [layer, expert, tokens, load_percent].
EXPERT_LOADS = "moe/expert_loads"
EXPERT_LOAD_COLUMNS = ("layer", "expert", "tokens", "load_percent")
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {EXPERT_LOADS: EXPERT_LOAD_COLUMNS}

# Routing consistency (rollout routes vs training routes), with track_routing_consistency.
ROUTING_DISAGREEMENT = "moe/routing_disagreement"
ROUTING_TOPK_OVERLAP = "moe/routing_topk_overlap"
ROUTING_TOKENS_ANY_LAYER_DIFFERS = "moe/routing_tokens_any_layer_differs"
ROUTING_MISSING_FRACTION = "moe/routing_missing_fraction"
ROUTING_REPLAY_MISMATCH = "moe/routing_replay_mismatch"  # only while router replay runs
ROUTING_KEYS = (
    ROUTING_DISAGREEMENT,
    ROUTING_TOPK_OVERLAP,
    ROUTING_TOKENS_ANY_LAYER_DIFFERS,
    ROUTING_MISSING_FRACTION,
    ROUTING_REPLAY_MISMATCH,
)
ROUTING_LAYER_STATS = ("routing_disagreement", "routing_topk_overlap")


def routing_layer_key(layer: int, stat: str) -> str:
    """``moe/layer_{i}/routing_disagreement`` or ``.../routing_topk_overlap`` (``i`` global)."""
    if stat not in ROUTING_LAYER_STATS:
        raise KeyError(
            f"unknown per-layer routing statistic {stat!r}; known: {ROUTING_LAYER_STATS}"
        )
    return f"{MOE_PREFIX}layer_{layer}/{stat}"


# Throughput and FLOPs.
TOKENS = "train_perf/tokens"
SECONDS = "train_perf/seconds"
TOKENS_PER_SECOND = "train_perf/tokens_per_second"
TOTAL_TOKENS = "train_perf/total_tokens"
TOTAL_SECONDS = "train_perf/total_seconds"
CUMULATIVE_TOKENS_PER_SECOND = "train_perf/cumulative_tokens_per_second"
ESTIMATED_FLOPS = "train_perf/estimated_flops"
ESTIMATED_FLOPS_PER_SECOND = "train_perf/estimated_flops_per_second"
CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND = "train_perf/cumulative_estimated_flops_per_second"
TFLOPS_PER_GPU = "train_perf/tflops_per_gpu"
MFU = "train_perf/mfu"
#: Estimated step time with this step's expert loads over the time with balanced loads.
EXPERT_IMBALANCE_SLOWDOWN = "train_perf/expert_imbalance_slowdown"

THROUGHPUT_KEYS = (
    TOKENS,
    SECONDS,
    TOKENS_PER_SECOND,
    TOTAL_TOKENS,
    TOTAL_SECONDS,
    CUMULATIVE_TOKENS_PER_SECOND,
)
FLOPS_KEYS = (
    ESTIMATED_FLOPS,
    ESTIMATED_FLOPS_PER_SECOND,
    CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND,
    TFLOPS_PER_GPU,
    MFU,
)
# The generation inside a training step (TRL's GRPO rollout with transformers' generate), through
# integrations.transformers: real tokens (prompt + completion up to its end), seconds, tokens/s.
GEN_PERF_PREFIX = "gen_perf/"
GENERATION_TOKENS = "gen_perf/tokens"
GENERATION_SECONDS = "gen_perf/seconds"
GENERATION_TOKENS_PER_SECOND = "gen_perf/tokens_per_second"
GENERATION_KEYS = (GENERATION_TOKENS, GENERATION_SECONDS, GENERATION_TOKENS_PER_SECOND)
BALANCE_SUMMARY_KEYS = (
    MAX_OVER_IDEAL,
    MAX_OVER_IDEAL_MAX,
    EP_IMBALANCE,
    EP_IMBALANCE_MAX,
    DEAD_EXPERTS,
    DROPPED_FRACTION,
    PADDING_FRACTION,
    ROUTED_TOKENS,
    MAX_OVER_IDEAL_P50,
    MAX_OVER_IDEAL_P90,
    WORST_LAYER,
)


def documented_key_patterns() -> list[str]:
    """Every key as written in the docs; per-layer keys with ``{i}`` and ``{name}`` placeholders."""
    keys = [aux_loss_key(n) for n in (*AUX_LOSS_TRACKER_NAMES.values(), Z_LOSS)]
    keys += [aux_loss_key(REAL_TOKENS_LOSS)]
    keys += [f"{MOE_PREFIX}{{name}}_layer_{{i}}"]
    keys += [*BALANCE_SUMMARY_KEYS, ZERO_EXPERT_FRACTION]
    keys += [f"{MOE_PREFIX}layer_{{i}}/{stat}" for stat in LAYER_STATS + OPTIONAL_LAYER_STATS]
    keys += [ALERTS, EXPERT_LOADS, *THROUGHPUT_KEYS, *FLOPS_KEYS, *GENERATION_KEYS]
    keys += [EXPERT_IMBALANCE_SLOWDOWN, *OVERLOAD_KEYS]
    keys += [f"{MOE_PREFIX}{kind}_overload_factor_layer_{{i}}" for kind in ("avg", "max")]
    keys += [*EXPERT_BIAS_KEYS, *(f"{MOE_PREFIX}layer_{{i}}/{s}" for s in BIAS_LAYER_STATS)]
    keys += [*ROUTING_KEYS, *(f"{MOE_PREFIX}layer_{{i}}/{s}" for s in ROUTING_LAYER_STATS)]
    keys += [*ROUTER_HEALTH_KEYS]
    keys += [f"{MOE_PREFIX}layer_{{i}}/{s}" for s in ROUTER_HEALTH_LAYER_STATS]
    return keys


# Keys the reference worker and the SFT/DPO/GRPO loops log next to the moe/ and train_perf/ keys.
TRAIN_LOSS = "train/loss"
TRAIN_NUM_MICROBATCHES = "train/num_microbatches"
TRAIN_NUM_SEQUENCES = "train/num_sequences"
TRAIN_TOKEN_ACCURACY = "train/token_accuracy"
TRAIN_REWARD = "train/reward"
TRAIN_REWARD_STD = "train/reward_std"
TRAIN_CLIP_FRACTION = "train/clip_fraction"
TRAIN_CHOSEN_REWARD = "train/chosen_reward"
TRAIN_REJECTED_REWARD = "train/rejected_reward"
TRAIN_PREFERENCE_ACCURACY = "train/preference_accuracy"
ALGORITHM_KEYS = (
    TRAIN_LOSS,
    TRAIN_NUM_MICROBATCHES,
    TRAIN_NUM_SEQUENCES,
    TRAIN_TOKEN_ACCURACY,
    TRAIN_REWARD,
    TRAIN_REWARD_STD,
    TRAIN_CLIP_FRACTION,
    TRAIN_CHOSEN_REWARD,
    TRAIN_REJECTED_REWARD,
    TRAIN_PREFERENCE_ACCURACY,
)

# Keys a Ray driver adds to each step (engine: ray; docs/en/ray.md): wall seconds as the driver
# sees them, Ray's calls and transfers included, and the tokens trained over the whole step.
DRIVER_STEP_SECONDS = "driver/step_seconds"
DRIVER_GENERATE_SECONDS = "driver/generate_seconds"
DRIVER_SCORE_SECONDS = "driver/score_seconds"
DRIVER_TRAIN_SECONDS = "driver/train_seconds"
DRIVER_TOKENS_PER_SECOND = "driver/tokens_per_second"
DRIVER_KEYS = (
    DRIVER_STEP_SECONDS,
    DRIVER_GENERATE_SECONDS,
    DRIVER_SCORE_SECONDS,
    DRIVER_TRAIN_SECONDS,
    DRIVER_TOKENS_PER_SECOND,
)
