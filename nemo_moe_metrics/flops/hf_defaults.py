"""Defaults of Hugging Face config classes, so a partial config.json is costed like transformers.

A ``config.json`` lists only what its author wrote down; transformers fills every other field
from the config class's declared default (``Qwen3MoeConfig`` has 128 experts unless told
otherwise). The FLOP estimators read plain dicts, so before a factory sees a config.json dict
its missing fields are filled here with the same defaults:

- from the installed transformers, when it imports and knows the ``model_type`` (the declared
  defaults of the config class registered for it; for a multimodal wrapper such as
  ``qwen3_5_moe``, of its ``text_config`` class);
- otherwise from ``hf_config_defaults.json`` beside this module, generated from transformers
  5.24 by ``python -m nemo_moe_metrics.flops.hf_defaults --write`` and checked by a test to
  equal the installed transformers' defaults.

Only declared defaults are filled. Values a config class derives in ``__post_init__`` from
other fields (``head_dim = hidden_size // num_attention_heads`` when unset,
``num_key_value_heads = num_attention_heads``, ``layer_types`` from ``sliding_window`` or
``full_attention_interval``) are derived by the estimators from the config's own values, the
same way; a test checks both routes against ``AutoConfig.for_model`` for every registered type.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).resolve().parent / "hf_config_defaults.json"

# The Hugging Face model types the shipped table covers: every type the registry costs from a
# Hugging Face config (the megatron-core type is not one).
HF_MODEL_TYPES: tuple[str, ...] = (
    "deepseek_v3",
    "gpt_oss",
    "llama",
    "mistral",
    "mixtral",
    "olmoe",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
)

_JSON_SCALARS = (bool, int, float, str, type(None))


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    return False


def _declared_defaults(cls: type) -> dict[str, Any]:
    """The defaults a transformers config class declares (base-class fields excluded).

    transformers 5 declares them as dataclass fields; older releases as ``__init__`` keywords.
    """
    from transformers import PretrainedConfig

    declared: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        base = (
            {f.name for f in dataclasses.fields(PretrainedConfig)}
            if dataclasses.is_dataclass(PretrainedConfig)
            else set()
        )
        for f in dataclasses.fields(cls):
            if f.name in base:
                continue
            if f.default is not dataclasses.MISSING:
                declared[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                declared[f.name] = f.default_factory()
    else:
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name != "self" and param.default is not inspect.Parameter.empty:
                declared[name] = param.default
    out: dict[str, Any] = {}
    for name, value in declared.items():
        if isinstance(value, tuple):
            value = list(value)
        if _jsonable(value):
            out[name] = value
    return out


def transformers_entry(model_type: str) -> dict[str, Any] | None:
    """The installed transformers' defaults for ``model_type``; None when it does not know it.

    ``{"config_class": name, "attribute_map": {...}, "defaults": {...}}``; for a wrapper with a
    ``text_config`` (qwen3_5, qwen3_5_moe) the entry describes the text config class.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return None
    sub = getattr(cls, "sub_configs", None) or {}
    if "text_config" in sub:
        cls = sub["text_config"]
    return {
        "config_class": cls.__name__,
        "attribute_map": dict(getattr(cls, "attribute_map", {}) or {}),
        "defaults": _declared_defaults(cls),
    }


@functools.lru_cache(maxsize=1)
def shipped_table() -> dict[str, Any]:
    """The shipped table: ``{"transformers_version": ..., "model_types": {type: entry}}``."""
    return json.loads(TABLE_PATH.read_text())


@functools.lru_cache(maxsize=1)
def _transformers_available() -> bool:
    try:
        import transformers.models.auto.configuration_auto  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _entry(model_type: str) -> dict[str, Any] | None:
    if _transformers_available():
        entry = transformers_entry(model_type)
        if entry is not None:
            return entry
    # No transformers, or one too old to know this model type.
    return shipped_table()["model_types"].get(model_type)


def defaults_source() -> str:
    """Where defaults come from in this process: ``"transformers"`` or ``"shipped table"``."""
    return "transformers" if _transformers_available() else "shipped table"


def _copy_aliases(data: dict[str, Any], attribute_map: Mapping[str, str]) -> None:
    # attribute_map aliases (qwen3_moe's num_experts is stored as num_local_experts): one
    # value under both spellings, whichever the config used.
    for alias, target in attribute_map.items():
        if data.get(target) is None and data.get(alias) is not None:
            data[target] = data[alias]
        elif data.get(alias) is None and data.get(target) is not None:
            data[alias] = data[target]


def fill_hf_defaults(data: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``data`` with every field it lacks set to the config class's default for ``model_type``.

    Fields present in ``data`` (an explicit ``null`` included) are kept; unknown model types
    come back unchanged. Derived fields are left to the estimators (see the module docstring).
    """
    out = dict(data)
    entry = _entry(model_type)
    if entry is None:
        return out
    amap = entry["attribute_map"]
    _copy_aliases(out, amap)
    for key, value in entry["defaults"].items():
        if key not in out:
            out[key] = copy.deepcopy(value)
    _copy_aliases(out, amap)
    return out


def build_table() -> dict[str, Any]:
    """The table as the installed transformers gives it (what ``--write`` stores)."""
    import transformers

    types = {}
    for model_type in HF_MODEL_TYPES:
        entry = transformers_entry(model_type)
        if entry is None:
            raise ValueError(f"transformers {transformers.__version__} has no {model_type!r}")
        types[model_type] = entry
    return {"transformers_version": transformers.__version__, "model_types": types}


def main(argv: list[str] | None = None) -> int:
    """Print the defaults table from the installed transformers, or ``--write`` it."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help=f"overwrite {TABLE_PATH.name}")
    args = parser.parse_args(argv)
    text = json.dumps(build_table(), indent=1, sort_keys=True) + "\n"
    if args.write:
        TABLE_PATH.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
