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
configs, validation rules). ``python tests/support/hf_families.py`` lists the families;
``python tests/support/hf_families.py --table`` prints the supported-models table of
docs/*/models.md.
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

_SMALL_LINEAR = dict(  # Gated DeltaNet heads (defaults: 16 x 128 keys, 32 x 128 values)
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_SMALL_DSA = dict(index_n_heads=4, index_head_dim=16, index_topk=8)  # a top-k below the lengths
_SMALL_INKLING = dict(
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    sliding_window_size=8,
    rel_extent=16,
    unpadded_vocab_size=VOCAB,
)

#: What a family needs beyond the shared size fields (keyed by model type): its layer pattern,
#: nested configs and validation rules, and whatever makes every kind of module it has (sparse
#: indexers, compressed or chunked attention, loops) run, small, in the tiny model.
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
    "kolibri1_1": dict(  # indexed (sparse) attention layers next to sliding ones
        index_num_heads=2,
        index_topk=8,
        index_pool_size=16,
        index_compression=2,
        index_num_local_tokens=4,
        index_num_sink_tokens=2,
        mlp_only_intermediate_size=32,
        layer_types=["sliding_attention", "indexed_attention"] * (LAYERS // 2),
        index_layers=[1],
    ),
    "qwen4_exp_text": dict(
        _SMALL_LINEAR,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
        ngram_vocab_size_base=512,
        hc_lowrank=8,
    ),
    **{t: _SMALL_LINEAR for t in ("qwen3_next", "qwen3_5_moe_text", "lara_mini")},
    **{t: _SMALL_DSA for t in ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4")},
    "dots3_note_text": dict(
        _SMALL_DSA,
        num_key_value_heads=4,  # its validator wants kv heads == heads
        # Its sliding layers' own sizes (defaults: 64 heads of 256, ranks 1024).
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=24,
        swa_kv_lora_rank=16,
        swa_head_dim=16,
        swa_qk_nope_head_dim=8,
        swa_v_head_dim=8,
    ),
    # Both compressed-attention kinds with rates below the test lengths (HCA's default is 128),
    # a CSA top-k that bites, a small indexer.
    "deepseek_v4": dict(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=4,
        index_head_dim=16,
        index_topk=2,
        o_lora_rank=8,  # default 1024: most of the tiny model's time
    ),
    "llama4_text": dict(attention_chunk_size=8),  # chunks shorter than the sequences
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, n_groups=1),  # default 128 x 64
    "jetmoe": dict(kv_channels=16),
    "inkling_text": _SMALL_INKLING,
    # Full and sliding layers, attention-residual blocks of 2 layers.
    "inkling2_text": dict(
        _SMALL_INKLING,
        n_layers_per_attn_res_block=2,
        layer_types=["hybrid_sliding", "hybrid"] * (LAYERS // 2),
    ),
    # Layers 1-2 looped 3 times (the default loop starts at layer 6).
    "inkling2_loop_text": dict(
        _SMALL_INKLING,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=3,
        layer_types=["hybrid_sliding", "hybrid"] * (LAYERS // 2),
    ),
    "zaya": dict(num_experts_per_tok=1),  # the family supports top-1 only
    "longcat_flash": dict(zero_expert_num=4),  # 4 zero-computation experts next to the 8
    # The MoE block on; a small per-layer input table (building 262144 x ... takes 11 s).
    "gemma4_text": dict(
        enable_moe_block=True, moe_intermediate_size=16, vocab_size_per_layer_input=VOCAB
    ),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),  # product keys: 4 x 4
    # DeepSeek-V2's own routing (V2-Lite and the default are "greedy": no groups)
    "deepseek_v2": dict(topk_method="group_limited_greedy"),
    # -- vision-language models: text configs by their own type, encoders by the model's --
    "ernie4_5_vl_moe_text": dict(  # text and vision experts; 3-D rotary over 8 frequencies
        moe_intermediate_size=[16, 16],
        rope_parameters=dict(rope_type="default", mrope_section=[3, 3, 2]),
    ),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1)),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1])),
    "hy_v4_vl_text": dict(
        _SMALL_DSA, rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1])
    ),
    "glm5_next_text": dict(  # NoPE indexed attention beside KDA layers, 3 MoE layers
        qk_rope_head_dim=0,
        layer_types=["linear_attention", "indexed_attention"] * (LAYERS // 2),
        mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1),
        linear_head_dim=16,
        linear_num_heads=4,
        **_SMALL_DSA,
        index_kpool=4,  # divides the index top-k
    ),
    "unlimited_ocr_text": dict(num_key_value_heads=4),
    "mistral_large4_text": _SMALL_DSA,
    "mistral_large4": dict(  # its vision config is any AutoConfig (Pixtral by default)
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            head_dim=16,
        )
    ),
    "muse_spark": dict(  # its audio encoder has one entry per stage
        audio_config=dict(
            num_hidden_layers=2, patch_sizes=(4, 2), hidden_sizes=(8, 16), depths=(1, 1)
        )
    ),
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


def _has_routed_experts(module_name: str) -> bool:
    import torch

    module = importlib.import_module(module_name)
    return any(
        is_experts_class(c) or _MOE_CLASS_NAME.search(c.__name__)
        for c in vars(module).values()
        if inspect.isclass(c) and c.__module__ == module.__name__ and issubclass(c, torch.nn.Module)
    )


#: Vision-language classes that train as language models (next-token loss from ``labels``);
#: not diffusion_gemma's ``...ForBlockDiffusion`` (docs/en/models.md says why).
_GENERATIVE = ("ForConditionalGeneration", "ForCausalLM")


@functools.cache
def moe_families() -> tuple[Family, ...]:
    """Every MoE model type of the installed transformers' causal-LM mapping, and of its
    image-text-to-text mapping where no causal-LM type shares the modeling module, sorted."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    def families_of(mapping: dict[str, str]) -> dict[str, list[Family]]:
        by_module: dict[str, list[Family]] = {}
        for model_type, class_name in sorted(mapping.items()):
            model_class = getattr(transformers, class_name, None)
            if model_class is not None and _has_routed_experts(model_class.__module__):
                family = Family(model_type, model_class, CONFIG_MAPPING[model_type])
                by_module.setdefault(model_class.__module__, []).append(family)
        return by_module

    by_module = families_of(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out = []
    for families in by_module.values():
        # A multimodal wrapper next to its own text config: the text config is the family.
        text_only = [
            f for f in families if "text_config" not in getattr(f.config_class, "sub_configs", {})
        ]
        out += text_only if text_only else families
    # Vision-language MoE models with no causal-LM type (qwen3_vl_moe, glm4v_moe, ...): the
    # whole multimodal model, as a VLM trainer loads it, run on text.
    for module, families in families_of(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES).items():
        if module not in by_module:
            out += [f for f in families if f.model_class.__name__.endswith(_GENERATIVE)]
    return tuple(sorted(out, key=lambda f: f.model_type))


def family(model_type: str) -> Family:
    """The :class:`Family` of ``model_type``."""
    for f in moe_families():
        if f.model_type == model_type:
            return f
    raise KeyError(f"{model_type!r} is not a MoE family of this transformers")


#: The same for the encoders of a vision-language model (vision, audio): one small layer.
_ENCODER_SIZE_RULES: tuple[tuple[str, Any], ...] = (
    (r"^(depth|num_hidden_layers|num_layers|encoder_layers)$", 1),
    (r"^(hidden_size|embed_dim|d_model)$", 32),
    (r"^(num_heads|num_attention_heads|encoder_attention_heads|num_key_value_heads)$", 2),
    (r"(^|_)intermediate_size$|^mlp_dim$|ffn_dim$", 32),
    (r"^global_attn_indexes$", (0,)),
    (r"^out_hidden_size$", H),  # what it hands the language model
)


def _matching(config_class: type, rules: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in (f.name for f in dataclasses.fields(config_class)):
        for pattern, value in rules:
            if re.search(pattern, name):
                kwargs[name] = value
                break
    return kwargs


def _tiny_encoder(config_class: type) -> dict[str, Any]:
    kwargs = _matching(config_class, _ENCODER_SIZE_RULES)
    for name, sub in getattr(config_class, "sub_configs", {}).items():  # deepseek_ocr2: SAM + LM
        if dataclasses.is_dataclass(sub):
            kwargs[name] = _tiny_encoder(sub)
    return kwargs


def tiny_kwargs(config_class: type) -> dict[str, Any]:
    """The config arguments that make ``config_class`` tiny (shared size rules + overrides).

    A vision-language config gets its text config tiny by the same rules and its encoders'
    configs one small layer (:data:`_ENCODER_SIZE_RULES`)."""
    sub_configs = getattr(config_class, "sub_configs", {})
    if "text_config" in sub_configs:
        kwargs = {
            name: tiny_kwargs(sub) if name == "text_config" else _tiny_encoder(sub)
            for name, sub in sub_configs.items()
            if dataclasses.is_dataclass(sub)
        }
        for name, changes in OVERRIDES.get(config_class.model_type, {}).items():
            kwargs[name] = {**kwargs.get(name, {}), **changes} if name in kwargs else changes
        return kwargs
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    kwargs = _matching(config_class, _SIZE_RULES)
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
    """A tiny config of ``model_type`` with eager attention and eager experts; ``changes`` on
    top."""
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


_SHARED: dict[str, Any] = {}


def shared_tiny_model(model_type: str, **changes: Any) -> Any:
    """``tiny_model(model_type, **changes)``, built once per process and shared by the tests.

    For tests that only read the model or run forward and backward (and zero the gradients
    they make, and remove the hooks they add); a test that changes weights or modules builds its
    own with :func:`tiny_model`.
    """
    key = f"{model_type}|{sorted(changes.items())!r}"
    if key not in _SHARED:
        _SHARED[key] = tiny_model(model_type, **changes)
    return _SHARED[key]


# -- the supported-models table (docs/en/models.md, docs/zh/models.md) -------------------------
TABLE_HEADER = (
    "| model type | model class | expert loads | aux loss | FLOPs | router health | notes |"
)


def _counted_by(spec: Any) -> str:
    from nemo_moe_metrics.adapters import hf as hf_models

    if spec is hf_models.EXPERTS:
        return "experts interface"
    if spec is hf_models.ZERO_COMPUTATION_EXPERTS:
        return "experts interface, zero-computation experts"
    named = {v: k for k, v in hf_models._NAMED.items()}
    return "adapter " + named[spec].rsplit(".", 1)[1]


def support_row(model_type: str) -> str:
    """One table row, read from the family's model built on the meta device."""
    import torch

    from nemo_moe_metrics import attach_collector
    from nemo_moe_metrics.adapters import hf as hf_models

    fam = family(model_type)
    with torch.device("meta"):
        model = fam.model_class(tiny_config(model_type))
    collector = attach_collector(model, num_layers=LAYERS)
    specs = {router.spec for router in collector.routers}
    counted = "; ".join(sorted(_counted_by(s) for s in specs))
    kind = hf_models.aux_loss_kind([model])
    sources = hf_models.router_logit_sources([model], collector.blocks) if kind else []
    aux = {"switch": "per layer", "doge": "per layer (product keys)", None: "none"}[kind]
    notes = []
    if kind and len(sources) < len(collector.layer_ids):
        notes.append("aux loss on the layers with a top-k router")
    if any(getattr(m, "e_score_correction_bias", None) is not None for m in model.modules()):
        notes.append("routing bias (aux-loss-free balancing)")
    flops, flops_note = flops_support(model_type)
    if flops_note:
        notes.append(f"FLOPs: {flops_note}")
    health, why = _health_support(collector)
    if why:
        notes.append(f"router health: {why}")
    return (
        f"| {model_type} | {fam.model_class.__name__} | {counted} | {aux} | {flops} | {health} | "
        f"{'; '.join(notes)} |"
    )


def _health_support(collector: Any) -> tuple[str, str]:
    """ "all layers", "some layers" or "no", and why not, from the routers' health readers."""
    found = []
    for router in collector.routers:
        spec = router.spec
        source = spec.health(router.module, router.parent) if spec.health else None
        found.append(source)
        if source is not None and not isinstance(source, str) and source.release is not None:
            source.release()  # the reader hooked the router: unhook it again
    reasons = sorted({f for f in found if isinstance(f, str)})
    judged = sum(1 for f in found if f is not None and not isinstance(f, str))
    if not reasons:
        return "all layers", ""
    return ("some layers" if judged else "no"), "; ".join(reasons)


def flops_support(model_type: str) -> tuple[str, str]:
    """The FLOPs cell ("formula", "modules" or "no") and its note, from the FLOPs matrix."""
    from tests.flops.test_hf_modules import flops_support as checked

    supported, note = checked(model_type)
    if not supported:
        return "no", note
    if note.startswith("registered formula"):
        return "formula", note.removeprefix("registered formula").removeprefix("; ")
    return "modules", note


@functools.cache
def support_table() -> list[str]:
    """The markdown table of every family, one row each (docs/*/models.md embed it)."""
    return [TABLE_HEADER, "|---|---|---|---|---|---|---|"] + [
        support_row(f.model_type) for f in moe_families()
    ]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    # The FLOPs matrix is a test module (tests.flops.test_hf_modules): import it from the root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if "--table" in sys.argv:  # what docs/*/models.md embed
        print("\n".join(support_table()))
    else:
        for f in moe_families():
            print(f"{f.model_type:22s} {f.model_class.__name__:34s} {f.config_class.__name__}")
        modules = len({f.module for f in moe_families()})
        print(f"{len(moe_families())} model types in {modules} modules")
