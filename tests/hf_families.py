"""Every MoE family the installed transformers ships, as a tiny random config that trains on CPU.

Discovery asks transformers itself, not a hand list: every model type of its causal-LM auto
mapping whose modeling module defines routed experts, recognised by transformers' own markers
(an experts class wrapped by ``use_experts_implementation``, or one called as
``experts(hidden_states, top_k_index, top_k_weights)``) or, for the few families that predate
that interface, by a class named ``...Experts`` / ``...MoE``. A multimodal wrapper type whose
text config is its own model type (``qwen3_5_moe`` next to ``qwen3_5_moe_text``) is represented
by the text type; aliases that reuse another family's modeling code (``sarvam_mla`` builds
``DeepseekV3ForCausalLM``) are kept, since their configs differ.

``tiny_config`` shrinks every size field the families share (hidden 64, 4 layers, 8 experts,
top-2, ...) and sets the eager attention and experts implementations FlopCounterMode and a CPU
need; :data:`OVERRIDES` holds what a family needs beyond that (its layer pattern, nested
configs, validation rules). ``python tests/hf_families.py`` lists the families.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

H, E, K, VOCAB, LAYERS = 64, 8, 2, 128, 4

#: (field-name pattern, tiny value) applied to every config field that matches, first match wins.
_SIZE_RULES: tuple[tuple[str, Any], ...] = (
    (r"^vocab_size$", VOCAB),
    (r"^hidden_size$", H),
    (r"^num_hidden_layers$", LAYERS),
    (r"^num_attention_heads$", 4),
    (r"^num_key_value_heads$", 2),
    (r"^head_dim$", 16),
    (r"^max_position_embeddings$", 256),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", E),
    (
        r"^(num_experts_per_tok|moe_topk|moe_k|num_experts_per_token|top_k_experts"
        r"|experts_per_token)$",
        K,
    ),
    (r"^(n_group|num_expert_group)$", 2),
    (r"^topk_group$", 1),
    (r"^moe_intermediate_size$", 16),
    (r"(^|_)intermediate_size$", 32),
    (r"ffn_hidden_size$", 32),
    (r"^kv_lora_rank$", 16),
    (r"^q_lora_rank$", 24),
    (r"^qk_nope_head_dim$", 8),
    (r"^qk_rope_head_dim$", 8),
    (r"^v_head_dim$", 8),
    (r"^sliding_window$", 8),
    (r"^first_k_dense_replace$", 1),
    (r"^(layer_types|mlp_layer_types)$", None),  # re-derived for 4 layers by the config class
)

#: What a family needs beyond the shared size fields (keyed by model type).
OVERRIDES: dict[str, dict[str, Any]] = {
    "dbrx": dict(
        d_model=H,
        n_heads=4,
        n_layers=LAYERS,
        max_seq_len=256,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=E, moe_top_k=K),
    ),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        use_mamba_kernels=False,
        mamba_d_state=8,
    ),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"] * (LAYERS // 2),
        mamba_n_heads=4,
        mamba_d_state=8,
        mamba_d_head=32,
        mamba_chunk_size=8,
        shared_intermediate_size=32,
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * (LAYERS // 2), num_dense_layers=1),
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        linear_head_dim=16,
        linear_num_heads=4,
    ),
    "bailing_hybrid": dict(layer_group_size=2),
    "kolibri1_1": dict(
        index_num_heads=2,
        index_topk=8,
        index_pool_size=16,
        index_compression=2,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
        mlp_only_intermediate_size=32,
    ),
    "qwen4_exp_text": dict(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
        ngram_vocab_size_base=512,
        hc_lowrank=8,
    ),
    "dots3_note_text": dict(num_key_value_heads=4),  # its validator wants kv heads == heads
    "zaya": dict(num_experts_per_tok=1),  # the family supports top-1 only
    "longcat_flash": dict(zero_expert_num=4),  # 4 zero-computation experts next to the 8
    "gemma4_text": dict(enable_moe_block=True, moe_intermediate_size=16),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),  # product keys: 4 x 4
    # DeepSeek-V2's own routing (V2-Lite and the default are "greedy": no groups)
    "deepseek_v2": dict(topk_method="group_limited_greedy"),
}

_MOE_CLASS_NAME = re.compile(r"(Experts|MoE|Moe|MoeBlock|MoEBlock|MoELayer)$")


def is_experts_class(cls: type) -> bool:
    """transformers' experts interface: ``use_experts_implementation`` or its call signature."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_filename.replace("\\", "/").endswith("integrations/moe.py"):
        return True
    try:
        params = list(inspect.signature(forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return params[1:3] == ["top_k_index", "top_k_weights"]


@dataclass(frozen=True)
class Family:
    """One MoE model type: its causal-LM class, config class and modeling module."""

    model_type: str
    model_class: type
    config_class: type

    @property
    def module(self) -> str:
        """The modeling module's short name (``qwen3_moe`` for ``modeling_qwen3_moe``)."""
        return self.model_class.__module__.split(".")[2]


@functools.cache
def moe_families() -> tuple[Family, ...]:
    """Every MoE model type of the installed transformers' causal-LM mapping, sorted."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_module: dict[str, list[Family]] = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        model_class = getattr(transformers, class_name, None)
        if model_class is None:
            continue
        module = importlib.import_module(model_class.__module__)
        classes = [
            c
            for c in vars(module).values()
            if inspect.isclass(c)
            and c.__module__ == module.__name__
            and issubclass(c, torch.nn.Module)
        ]
        if not any(is_experts_class(c) or _MOE_CLASS_NAME.search(c.__name__) for c in classes):
            continue
        family = Family(model_type, model_class, CONFIG_MAPPING[model_type])
        by_module.setdefault(model_class.__module__, []).append(family)
    out = []
    for families in by_module.values():
        # A multimodal wrapper next to its own text config: the text config is the family.
        text_only = [
            f for f in families if "text_config" not in getattr(f.config_class, "sub_configs", {})
        ]
        out += text_only if text_only else families
    return tuple(sorted(out, key=lambda f: f.model_type))


def family(model_type: str) -> Family:
    """The :class:`Family` of ``model_type``."""
    for f in moe_families():
        if f.model_type == model_type:
            return f
    raise KeyError(f"{model_type!r} is not a MoE family of this transformers")


def tiny_kwargs(config_class: type) -> dict[str, Any]:
    """The config arguments that make ``config_class`` tiny (shared size rules + overrides)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    kwargs: dict[str, Any] = {}
    for name in fields:
        for pattern, value in _SIZE_RULES:
            if re.search(pattern, name):
                kwargs[name] = value
                break
    if "qk_rope_head_dim" in fields and "head_dim" in fields:
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA families: rotary width
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)  # MLA: one kv per q
    if "num_layers" in fields and "num_hidden_layers" not in fields:
        kwargs["num_layers"] = LAYERS
    for token, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if token in fields:  # the defaults point into the full-size vocabulary
            kwargs[token] = value
    for name in ("n_shared_experts", "num_shared_experts"):
        if name in fields and fields[name].default is None:
            kwargs[name] = 1
    kwargs.update(OVERRIDES.get(config_class.model_type, {}))
    return kwargs


def tiny_config(model_type: str, **changes: Any) -> Any:
    """A tiny config of ``model_type`` with eager attention and eager experts; ``changes`` on top."""
    fam = family(model_type)
    config = fam.config_class(**{**tiny_kwargs(fam.config_class), **changes})
    for cfg in {id(config): config, id(text := config.get_text_config()): text}.values():
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
    return config


def tiny_model(model_type: str, seed: int = 0, **changes: Any) -> Any:
    """A random-init causal LM of ``model_type`` in train mode."""
    import torch

    torch.manual_seed(seed)
    return family(model_type).model_class(tiny_config(model_type, **changes)).train()


if __name__ == "__main__":
    for f in moe_families():
        print(f"{f.model_type:22s} {f.model_class.__name__:34s} {f.config_class.__name__}")
    print(f"{len(moe_families())} model types in {len({f.module for f in moe_families()})} modules")
