"""Typed recipe configuration: metric flags, model section, training section, YAML loading.

The models here (flags, model, policy, training, algorithms, alerts, logger, the whole
:class:`Recipe`) and reading a recipe: YAML, dotted overrides, validation. Their strict base
and the wording of their errors: ``strict_model.py``; which layers are MoE: ``layer_pattern.py``.

A recipe is YAML; its metric flags sit under ``policy.megatron_cfg`` as in NeMo RL. Unlike a
TypedDict, every model here rejects unknown keys and names the closest valid one, so a typo
such as ``track_moe_metric`` fails loudly instead of silently leaving a metric off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from nemo_moe_metrics.config.layer_pattern import hybrid_layer_symbols, moe_layer_flags
from nemo_moe_metrics.config.run_name import check_run_name
from nemo_moe_metrics.config.strict_model import ConfigError, StrictModel, recipe_error_text


class MetricsConfig(StrictModel):
    """The observability flags a Megatron policy worker reads (all off by default)."""

    track_moe_metrics: bool = Field(
        False, description="Router aux losses and expert-load balance under moe/."
    )
    moe_per_layer_logging: bool = Field(
        False, description="Also log per-layer moe/ values (needs track_moe_metrics)."
    )
    track_throughput: bool = Field(False, description="Step timing and tokens/s under train_perf/.")
    track_flops: bool = Field(
        False,
        description="Estimated FLOPs, FLOP/s, TFLOP/s per GPU and MFU (needs track_throughput).",
    )
    log_expert_table: bool = Field(
        True,
        description="Emit the moe/expert_loads table (layer, expert, tokens, load_percent).",
    )
    peak_flops_per_gpu: float | None = Field(
        None,
        gt=0,
        description=(
            "Dense peak FLOP/s of one accelerator for MFU; None looks it up by device name."
        ),
    )
    aux_loss_tracker: Literal["own", "shared"] = Field(
        "own",
        description="Who clears megatron's aux-loss tracker after each step. own: finish_step "
        "reads and clears it. shared: finish_step reads a copy and leaves the tracker to the "
        "framework's own report (training_log's track_moe_metrics in Megatron-Bridge and "
        "Megatron-LM, get_moe_metrics in NeMo RL), which then logs what it logs without us.",
    )
    track_routing_consistency: bool = Field(
        False,
        description="Compare the rollout engine's routes (microbatch(rollout_routes=...)) with "
        "the training routers' choices: moe/routing_* (needs track_moe_metrics).",
    )
    track_router_health: bool = Field(
        False,
        description="Router decision health from the routers' own logits: confidence, entropy, "
        "top-k gap, near ties, logit size, expert-bias overlap, micro-batch balance "
        "(moe/router_*, needs track_moe_metrics; docs/en/router_health.md).",
    )
    router_near_tie_gap: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="A decision whose top-k relative gap (s_k - s_k+1) / |s_k| is below this is "
        "a near tie (moe/router_near_tie_fraction); 0.01 is inside bf16 rounding.",
    )

    @model_validator(mode="after")
    def _check_contradictions(self) -> MetricsConfig:
        if self.moe_per_layer_logging and not self.track_moe_metrics:
            raise ValueError(
                "moe_per_layer_logging: true needs track_moe_metrics: true "
                "(per-layer values are part of the MoE metrics); turn both on or both off"
            )
        if self.track_routing_consistency and not self.track_moe_metrics:
            raise ValueError(
                "track_routing_consistency: true needs track_moe_metrics: true (the routing "
                "comparison runs in the MoE router hooks); turn track_moe_metrics on"
            )
        if self.track_router_health and not self.track_moe_metrics:
            raise ValueError(
                "track_router_health: true needs track_moe_metrics: true (router health is "
                "measured in the MoE router hooks); turn track_moe_metrics on"
            )
        if self.track_flops and not self.track_throughput:
            raise ValueError(
                "track_flops: true needs track_throughput: true (FLOP/s and MFU are rates "
                "over the measured step time); set track_throughput: true"
            )
        return self


class MegatronConfig(MetricsConfig):
    """``policy.megatron_cfg``: parallel layout of the Megatron policy plus the metric flags."""

    expert_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    recompute_granularity: Literal["full", "selective"] | None = None
    moe_enable_routing_replay: bool = Field(
        False,
        description="Rollout Routing Replay (R3): training forwards execute the experts the "
        "rollout chose, through megatron-core's RouterReplay (GRPO only).",
    )

    def metrics(self) -> MetricsConfig:
        """The metric flags alone, as the worker integration takes them."""
        return MetricsConfig(**{k: getattr(self, k) for k in MetricsConfig.model_fields})


class ModelConfig(StrictModel):
    """A small megatron-core GPT model with MoE layers (field names follow TransformerConfig)."""

    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(64, ge=1)
    ffn_hidden_size: int = Field(128, ge=1, description="Width of dense (non-MoE) MLP layers.")
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1)
    kv_channels: int | None = Field(None, ge=1, description="Head dim; default hidden/heads.")
    vocab_size: int = Field(128, ge=2)
    seq_length: int = Field(32, ge=2)
    swiglu: bool = True
    num_experts: int | None = Field(8, ge=1, description="None builds a dense model.")
    moe_router_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: int = Field(64, ge=1)
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1)
    moe_layer_freq: int | list[int] = Field(
        1, description="1 = every layer MoE; a list of 0/1 per layer, e.g. [0, 1, 1, 1]."
    )
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    ] = "aux_loss"
    moe_aux_loss_coeff: float = Field(1e-2, ge=0)
    moe_z_loss_coeff: float | None = Field(None, ge=0)
    moe_expert_capacity_factor: float | None = Field(None, gt=0)
    moe_router_enable_expert_bias: bool = Field(
        False,
        description=(
            "Aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias that megatron "
            "moves by moe_router_bias_update_rate after each step; logged as "
            "moe/expert_bias_range and moe/expert_bias_update. Routes with sigmoid scores."
        ),
    )
    moe_router_bias_update_rate: float = Field(1e-3, gt=0)
    hybrid_layer_pattern: str | None = Field(
        None,
        description=(
            "Build a megatron-core hybrid model (HybridModel; MambaModel on megatron-core 0.16) "
            "with one layer per symbol: * attention, - dense MLP, E MoE (e.g. '*E*E'). "
            "num_layers must equal the pattern's length; MoE layers come from the E symbols, "
            "so leave moe_layer_freq at 1. None builds a GPTModel."
        ),
    )

    @field_validator("hybrid_layer_pattern")
    @classmethod
    def _check_pattern(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            hybrid_layer_symbols(pattern)  # a bad symbol is reported at this field's path
        return pattern

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.hybrid_layer_pattern is not None:
            symbols = hybrid_layer_symbols(self.hybrid_layer_pattern)
            if len(symbols) != self.num_layers:
                raise ValueError(
                    f"hybrid_layer_pattern {self.hybrid_layer_pattern!r} has {len(symbols)} "
                    f"layers but num_layers is {self.num_layers}; set num_layers: {len(symbols)}"
                )
            if self.moe_layer_freq != 1:
                raise ValueError(
                    "moe_layer_freq does not apply to a hybrid_layer_pattern model: its E "
                    "symbols are the MoE layers; remove moe_layer_freq"
                )
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_experts={self.num_experts}"
            )
        if (
            self.num_attention_heads
            and self.hidden_size % self.num_attention_heads
            and (self.kv_channels is None)
        ):
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels explicitly"
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}"
            )
        if isinstance(self.moe_layer_freq, list):
            if len(self.moe_layer_freq) != self.num_layers:
                raise ValueError(
                    f"moe_layer_freq has {len(self.moe_layer_freq)} entries but num_layers is "
                    f"{self.num_layers}; give one 0/1 entry per layer"
                )
            if any(v not in (0, 1) for v in self.moe_layer_freq):
                raise ValueError("moe_layer_freq entries must be 0 (dense) or 1 (MoE)")
        return self

    @property
    def is_moe(self) -> bool:
        """Whether the model has at least one MoE layer."""
        return bool(self.num_experts) and any(self.moe_layer_pattern())

    def moe_layer_pattern(self) -> list[int]:
        """One 0/1 entry per layer, 1 where the layer is MoE."""
        if not self.num_experts:
            return [0] * self.num_layers
        return moe_layer_flags(self.num_layers, self.moe_layer_freq, self.hybrid_layer_pattern)


class PolicyConfig(StrictModel):
    """``policy``: the model being trained and how its batches are cut into microbatches."""

    # Required: a recipe that forgets its model must not silently train the tiny demo model.
    model: ModelConfig
    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig)
    train_global_batch_size: int = Field(
        8,
        ge=1,
        description=(
            "Sequences per optimizer step over ALL data-parallel ranks together, as NeMo RL's "
            "and Megatron's global batch: each rank trains train_global_batch_size / "
            "data-parallel size of them, so it must be a multiple of data-parallel size x "
            "train_micro_batch_size (checked before launch; `check` prints the split). It "
            "used to count one rank's sequences: an older recipe multiplies it by the "
            "data-parallel size to train the same batch."
        ),
    )
    train_micro_batch_size: int = Field(
        2, ge=1, description="Sequences per microbatch (on one data-parallel rank)."
    )

    @model_validator(mode="after")
    def _check_batches(self) -> PolicyConfig:
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"train_global_batch_size={self.train_global_batch_size} is not a multiple of "
                f"train_micro_batch_size={self.train_micro_batch_size}"
            )
        return self


class TrainingConfig(StrictModel):
    """``training``: loop length, optimiser and the synthetic data."""

    max_steps: int = Field(8, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    seed: int = 1234
    min_seq_length: int = Field(8, ge=1, description="Shortest synthetic sequence (padding test).")


class DPOConfig(StrictModel):
    """``dpo``: preference optimisation settings."""

    beta: float = Field(0.1, gt=0)

    @staticmethod
    def response_length(seq_length: int) -> int:
        """Response tokens per synthetic preference pair: a quarter of the context (at least
        one)."""
        return max(1, seq_length // 4)


class GRPOConfig(StrictModel):
    """``grpo``: group-relative policy optimisation settings.

    One rollout batch per optimizer step: ``policy.train_global_batch_size`` rollouts over all
    data-parallel ranks, i.e. ``train_global_batch_size / num_generations`` prompts (NeMo RL's
    ``num_prompts_per_step``) of ``num_generations`` rollouts each.
    """

    #: NeMo RL's GRPO keys, named with what they are here (a copied section fails helpfully).
    foreign_keys: ClassVar[dict[str, str]] = {
        "num_generations_per_prompt": (
            "NeMo RL's grpo.num_generations_per_prompt is grpo.num_generations here"
        ),
        "num_prompts_per_step": "NeMo RL's grpo.num_prompts_per_step is set here through "
        "policy.train_global_batch_size = num_prompts_per_step x grpo.num_generations (all "
        "data-parallel ranks; one optimizer step per rollout batch); remove it",
    }

    num_generations: int = Field(
        4,
        ge=2,
        description="Rollouts per prompt (the group; NeMo RL's num_generations_per_prompt).",
    )
    prompt_length: int = Field(8, ge=1)
    response_length: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    rollout_precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Precision of the rollout forwards (bf16: autocast, as an inference engine "
        "runs, so its expert choices differ from the fp32 training forwards).",
    )


#: ``logger.table_every`` default. At 94 x 256 one table step costs about 57 KB in the store
#: and 630 KB in W&B's offline files (measured, benchmarks/store_bench.py); every 20th step of
#: a 10,000-step run is 500 tables, about 345 MB, plus about 35 MB of scalars in JSONL,
#: TensorBoard and W&B with the default flags: under 2 GB with room to spare, and W&B's
#: ~0.8 s per table becomes ~40 ms per step. docs/en/storage.md has the budget.
DEFAULT_TABLE_EVERY = 20


class AlertsConfig(StrictModel):
    """``logger.alerts``: one warning line when an expert-balance threshold is crossed.

    Checked on rank 0 from the numbers each step already logs (no collective, no device read);
    ``moe/alerts`` counts the crossings of each step. A threshold set to null is not checked.
    """

    enabled: bool = Field(False, description="Check the thresholds below at every logged step.")
    max_over_ideal: float | None = Field(
        4.0, gt=1, description="A layer's busiest expert above this multiple of the ideal load."
    )
    dead_steps: int | None = Field(
        10, ge=1, description="An expert with no token for this many consecutive logged steps."
    )
    drift: float | None = Field(
        0.1,
        gt=0,
        le=1,
        description="Jensen-Shannon divergence (bits, 0..1) of a layer's expert shares between "
        "two consecutive logged steps.",
    )
    dropped_fraction: float | None = Field(
        0.1, gt=0, le=1, description="Share of a layer's top-k choices dropped by expert capacity."
    )
    routing_disagreement: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="A layer (or, without per-layer keys, all layers) whose training router "
        "disagrees with the rollout's routes on more than this share of (token, layer) pairs "
        "(moe/routing_disagreement, track_routing_consistency).",
    )
    router_near_tie_fraction: float | None = Field(
        0.5,
        gt=0,
        le=1,
        description="A layer (or, without per-layer keys, the worst layer) whose router decides "
        "more than this share of tokens by a near tie (moe/router_near_tie_fraction, "
        "track_router_health).",
    )
    router_logit_max_abs: float | None = Field(
        50.0,
        gt=0,
        description="A layer (or, without per-layer keys, any layer) whose largest router logit "
        "exceeds this in absolute value: growing logits precede divergence "
        "(moe/router_logit_max_abs, track_router_health).",
    )
    max_lines_per_step: int = Field(
        10, ge=1, description="Warning lines printed per step; the rest are counted in one line."
    )


class LoggerConfig(StrictModel):
    """``logger``: where metrics go."""

    jsonl_enabled: bool = True
    tensorboard_enabled: bool = True
    wandb_enabled: bool = True
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "nemo_moe_metrics"
    table_every: int = Field(
        DEFAULT_TABLE_EVERY,
        ge=1,
        description="Write the moe/expert_loads table (expert-load store, W&B) on steps that are "
        "multiples of N; scalars go every step. The default keeps a 10,000-step run at "
        "94 layers x 256 experts under 2 GB in total (docs/en/scale.md).",
    )
    wandb_table_every: int | None = Field(
        None,
        ge=1,
        description="W&B's own table cadence (a 94 x 256 table costs W&B about 1 s of host "
        "time); None follows table_every.",
    )
    mlflow_enabled: bool = Field(
        False,
        description="Log to MLflow (extra 'mlflow'): scalars as metrics with their step, the "
        "moe/expert_loads table as a CSV artifact on table_every steps.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; None: a SQLite database in the run directory "
        "(sqlite:///<run_dir>/mlflow.db, artifacts in <run_dir>/mlflow_artifacts).",
    )
    mlflow_experiment: str = "nemo_moe_metrics"
    trackio_enabled: bool = Field(
        False,
        description="Log the scalars to trackio (extra 'trackio'): a local SQLite store in "
        "<run_dir>/trackio, no network; open it with TRACKIO_DIR=<run_dir>/trackio trackio show.",
    )
    resume: bool = Field(
        False,
        description="Continue the run in the output directory: steps, train_perf/total_* and "
        "the cumulative rates go on from its last logged step; JSONL and the store append; "
        "TensorBoard, W&B and MLflow continue the same run. Model weights are not restored.",
    )
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)

    @property
    def wandb_table_cadence(self) -> int:
        """Steps between two W&B tables: ``wandb_table_every``, else ``table_every``."""
        return self.wandb_table_every or self.table_every


class RayConfig(StrictModel):
    """``ray``: how the Ray engine's driver waits for its workers (``engine: ray``)."""

    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds the driver waits for the placement group, the actors and their "
        "process group to be up; then it stops them and names the ranks not ready.",
    )
    step_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds one call of every worker (generate, log-probs, a training step) "
        "may take; then the driver stops the run naming the ranks still busy and their nodes.",
    )


class Recipe(StrictModel):
    """A whole recipe: which algorithm, the policy with its flags, training and logging."""

    words_its_own_errors: ClassVar[bool] = True  # recipe_from_dict names file and override
    name: str = "run"
    algorithm: Literal["sft", "dpo", "grpo"] = "sft"
    engine: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="torchrun: every rank runs the loop (SPMD), rank 0 logs. ray: one driver "
        "runs the loop and calls a worker group of Ray actors, one per rank, as NeMo RL does "
        "(docs/en/ray.md); nemo-moe-metrics run --engine ray sets it.",
    )
    ray: RayConfig = Field(default_factory=RayConfig)
    policy: PolicyConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)

    @field_validator("name", mode="before")
    @classmethod
    def _check_name(cls, name: Any) -> Any:
        # `name=` (an empty override) is YAML's null: say what an empty name is, not its type.
        if name is None:
            name = ""
        if isinstance(name, str):
            return check_run_name(name)  # the run directory's name: it must not leave --output-dir
        return name

    @model_validator(mode="after")
    def _check_router_replay(self) -> Recipe:
        if self.policy.megatron_cfg.moe_enable_routing_replay and self.algorithm != "grpo":
            raise ValueError(
                "policy.megatron_cfg.moe_enable_routing_replay replays the rollout's routes, "
                f"which only the grpo loop has (algorithm is {self.algorithm}); turn it off"
            )
        return self


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict copy."""
    result = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override '{item}' is not of the form dotted.key=value "
                "(e.g. policy.megatron_cfg.track_flops=true)"
            )
        parts = key.strip().split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"override '{item}': '{prefix}' is a value, not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(
                f"override '{item}': the value of '{key.strip()}' is not valid YAML ({problem}); "
                "quote it, e.g. key='\"text\"', or write a YAML value such as 3, true or [1, 2]"
            ) from None
    return result


def recipe_from_dict(
    data: dict[str, Any],
    source: str = "<dict>",
    overrides: list[str] | None = None,
    without_overrides: dict[str, Any] | None = None,
) -> Recipe:
    """Validate a recipe dict; raise ConfigError with every problem named by its dotted path.

    With ``overrides`` (already applied to ``data``) and ``without_overrides`` (the dict before
    them), a problem only the overrides bring in is named after its override.
    """
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        file_errors: set[tuple[tuple[Any, ...], str]] = set()
        if overrides and without_overrides is not None:
            try:
                Recipe.model_validate(without_overrides)
            except ValidationError as plain:
                file_errors = {(tuple(e["loc"]), e["msg"]) for e in plain.errors()}
        raise ConfigError(recipe_error_text(err, source, overrides, file_errors)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML says keys are
    unique; PyYAML keeps the last silently, so a flag set twice would hide the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "keep one of them",
                    key_node.start_mark,
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and its line (not PyYAML's quoted excerpt)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if not problem:
        return " ".join(str(err).split())
    context = getattr(err, "context", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{context + ': ' if context else ''}{problem}{where}"


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe, apply dotted overrides, and validate it.

    A problem the file has on its own is reported against the file; one that only the
    overrides bring in is reported against the override (``override 'k=v': ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"recipe {path} is not UTF-8 text: byte {raw[err.start]:#04x} on line {line}; save "
            "it as UTF-8 (YAML recipes are UTF-8)"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506  # a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping at the top level")
    overrides = list(overrides or [])
    return recipe_from_dict(apply_overrides(data, overrides), str(path), overrides, data)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text that load_recipe reads back to an equal recipe."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
