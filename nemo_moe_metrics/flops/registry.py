"""The FLOP estimator registry and its dispatch.

``model_type`` -> estimator factory (the registered formulas, and ``register_flops_estimator``
for a user's own), config normalisation (a transformers config, a config.json dict, a
megatron-core ``TransformerConfig``), and :func:`get_flops_estimator`'s choice: a torchtitan
config read layer by layer, else a registered formula, else the transformers model's modules
(:mod:`nemo_moe_metrics.flops.hf_modules`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from nemo_moe_metrics.flops import deepseek, hf_defaults, hf_dense, hf_moe, megatron, qwen_hybrid
from nemo_moe_metrics.flops.core import FlopsEstimator
from nemo_moe_metrics.flops.errors import NotInTransformersError, UnknownModelTypeError
from nemo_moe_metrics.flops.torchtitan import is_torchtitan_config, torchtitan_flops_estimator
from nemo_moe_metrics.runtime.extras import install_hint

Factory = Callable[[Mapping[str, Any]], FlopsEstimator]

_REGISTRY: dict[str, Factory] = {}


def register_flops_estimator(model_type: str, factory: Factory) -> None:
    """Register ``factory(config_dict) -> estimator`` for ``model_type``; a second call replaces.

    The factory receives the config as a plain dict (``text_config`` unwrapped, ``vocab_size``
    overridden when given); for a megatron-core TransformerConfig the dict holds its fields plus
    ``vocab_size`` and ``model_type="megatron_gpt"``. It returns a callable
    ``est(seq_lens, *, causal=True) -> FlopsBreakdown``, usually
    ``FlopsEstimator(ModelShape(...))``. A config.json dict of a type transformers knows has
    its missing fields filled with the config class's defaults first (see hf_defaults).
    """
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    if not callable(factory):
        raise TypeError(
            f"factory for {model_type!r} must be callable, got {type(factory).__name__}"
        )
    if model_type in _REGISTRY:
        warnings.warn(
            f"register_flops_estimator: replacing the estimator registered for {model_type!r}",
            stacklevel=2,
        )
    _REGISTRY[model_type] = factory


def registered_model_types() -> list[str]:
    """The model types with a registered estimator, sorted."""
    return sorted(_REGISTRY)


def _unknown(model_type: Any) -> UnknownModelTypeError:
    what = "has no model_type" if model_type is None else f"has model_type {model_type!r}"
    return UnknownModelTypeError(
        f"the config {what}, which has no FLOP estimator: no formula is registered for it and "
        "the installed transformers has no causal LM or image-text-to-text model to read it "
        "from. Registered types: "
        f"{', '.join(registered_model_types())}. Register one with "
        "nemo_moe_metrics.flops.register_flops_estimator('<model_type>', factory), where "
        "factory(config_dict) returns FlopsEstimator(ModelShape(...)) or any callable "
        "est(seq_lens, *, causal=True) -> FlopsBreakdown"
    )


def normalise_config(config: Any, *, vocab_size: int | None = None) -> dict[str, Any]:
    """Any supported config as the plain dict factories receive (see register_flops_estimator)."""
    if megatron.is_megatron_config(config):
        return megatron.megatron_config_to_dict(config, vocab_size)
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        # transformers PretrainedConfig: to_dict() holds defaults the class derived in __init__.
        outer_type = getattr(config, "model_type", None)
        text = getattr(config, "text_config", None)
        if text is not None and hasattr(text, "to_dict"):
            config = text
        data = config.to_dict()
        # attribute_map aliases (Qwen3MoeConfig stores num_experts as num_local_experts):
        # expose both spellings so factories can read the config.json names.
        for alias, target in getattr(config, "attribute_map", {}).items():
            if data.get(alias) is None and data.get(target) is not None:
                data[alias] = data[target]
        if text is not None:
            data["_outer_model_type"] = outer_type
    elif isinstance(config, Mapping):
        data = dict(config)
        text = data.get("text_config")
        if isinstance(text, Mapping):
            outer_type = data.get("model_type")
            data = dict(text)
            data["_outer_model_type"] = outer_type
        # A config.json holds only what its author wrote: fill the rest with the config
        # class's defaults, as transformers does when it loads the file.
        defaults_type = data.get("model_type") or data.get("_outer_model_type")
        if isinstance(defaults_type, str):
            data = hf_defaults.fill_hf_defaults(data, defaults_type)
    else:
        raise TypeError(
            "config must be a transformers PretrainedConfig, a config.json dict or a "
            f"megatron-core TransformerConfig, got {type(config).__name__}"
        )
    if data.get("model_type") is None and data.get("_outer_model_type") is not None:
        data["model_type"] = data["_outer_model_type"]
    if vocab_size is not None:
        if vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
        data["vocab_size"] = int(vocab_size)
    return data


def get_flops_estimator(
    config: Any, *, vocab_size: int | None = None, model: Any = None
) -> FlopsEstimator:
    """The FLOP estimator for a model config; UnknownModelTypeError when there is none.

    ``config``: a transformers PretrainedConfig, a config.json dict (``text_config`` is
    unwrapped) or a megatron-core TransformerConfig (then ``vocab_size`` is required: it sizes
    the lm_head; 0 leaves the lm_head out). ``vocab_size`` also overrides a HF config's value.

    A registered ``model_type`` uses its formula. Any other type transformers knows is read
    from its modules (:mod:`nemo_moe_metrics.flops.hf_modules`): from ``model`` when given (the
    built model itself, e.g. at attach), else from a skeleton of the config's causal LM (or, for
    a vision-language model without one, its image-text-to-text model: the text decoder is
    costed, not the encoders) built on the meta device (no memory, well under a second even
    for 671B parameters).
    """
    if is_torchtitan_config(config):  # read layer by layer, not through a config dict
        return torchtitan_flops_estimator(config, vocab_size=vocab_size)
    data = normalise_config(config, vocab_size=vocab_size)
    model_type = data.get("model_type")
    factory = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if factory is None:
        # Multimodal wrappers: the text config's own type (e.g. qwen3_5_moe_text) may be
        # registered under the outer name only.
        outer = data.get("_outer_model_type")
        factory = _REGISTRY.get(outer) if isinstance(outer, str) else None
    if factory is not None:
        return factory(data)
    if megatron.is_megatron_config(config):
        raise _unknown(model_type)
    return _from_transformers_modules(config, model, vocab_size, model_type)


def _from_transformers_modules(
    config: Any, model: Any, vocab_size: int | None, model_type: Any
) -> FlopsEstimator:
    """The estimate read from a transformers model's modules: ``model``, else a meta skeleton."""
    try:
        # Imported here: reading modules needs torch, the formulas above do not.
        from nemo_moe_metrics.flops import hf_modules
    except ImportError as err:  # no torch: only the formulas are available
        raise _unknown(model_type) from err
    if model is not None and hf_modules.is_readable(model):
        # The model that runs, custom modules included; a module no rule knows is an error
        # (UnsupportedModelError), not a guess from the stock architecture.
        return hf_modules.estimator_from_model(model, vocab_size=vocab_size)
    # No model, or a wrapper that sharded or offloaded its weights in place: the config.
    try:
        hf_config = hf_modules.transformers_config(config)
        return hf_modules.estimator_from_config(hf_config, vocab_size=vocab_size)
    except NotInTransformersError as err:
        raise _unknown(model_type) from err
    except ImportError as err:
        if (err.name or "").split(".")[0] != "transformers":
            raise _unknown(model_type) from err
        raise UnknownModelTypeError(
            f"model_type {model_type!r} has no FLOP formula; its FLOPs are read from the "
            f"transformers model, but transformers is not installed: {install_hint('hf')}"
        ) from err
    except UnknownModelTypeError:
        raise
    except Exception as err:  # the config class or the model rejected the fields
        raise ValueError(
            f"model_type {model_type!r} has no FLOP formula, and transformers could not build "
            f"its model from this config to read the FLOPs from: {err}"
        ) from err


def try_get_flops_estimator(
    config: Any, *, vocab_size: int | None = None, model: Any = None
) -> FlopsEstimator | None:
    """The estimator, or None after a warning when there is none for this model.

    For the training integration: call it once at setup (with the built ``model`` for a
    transformers model) and omit the FLOP metrics on None (never report 0). Other
    configuration errors still raise.
    """
    try:
        return get_flops_estimator(config, vocab_size=vocab_size, model=model)
    except UnknownModelTypeError as err:
        warnings.warn(f"FLOP metrics disabled: {err}", stacklevel=2)
        return None


for _name in ("llama", "mistral", "qwen2", "qwen3"):
    _REGISTRY[_name] = hf_dense.dense_decoder
_REGISTRY.update(
    {
        "qwen2_moe": hf_moe.qwen2_moe,
        "qwen3_moe": hf_moe.qwen3_moe,
        "mixtral": hf_moe.mixtral,
        "olmoe": hf_moe.olmoe,
        "gpt_oss": hf_moe.gpt_oss,
        "deepseek_v3": deepseek.deepseek_v3,
        "qwen3_next": qwen_hybrid.qwen3_next,
        "qwen3_5": qwen_hybrid.qwen3_5,
        "qwen3_5_text": qwen_hybrid.qwen3_5,
        "qwen3_5_moe": qwen_hybrid.qwen3_5_moe,
        "qwen3_5_moe_text": qwen_hybrid.qwen3_5_moe,
        megatron.MEGATRON_MODEL_TYPE: megatron.megatron_gpt,
    }
)
