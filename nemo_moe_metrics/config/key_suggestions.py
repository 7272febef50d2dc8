"""Where a configuration key given in the wrong section lives: ``track_router_health=false``
at the top of a recipe is ``policy.megatron_cfg.track_router_health``.

Plain introspection of pydantic model classes (their ``model_fields``), so the config module
and anything else with nested models can ask it without an import back.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes an annotation holds (``X``, ``X | None``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def nested_key_paths(model: type[BaseModel], key: str, prefix: str = "") -> list[str]:
    """Dotted paths below ``model`` whose last part is ``key``, or is close to it when no
    section holds ``key`` itself; exact matches first, shortest first."""
    exact: list[str] = []
    close: list[str] = []
    for name, field in model.model_fields.items():
        for sub in _models_in(field.annotation):
            path = f"{prefix}{name}."
            fields = sorted(sub.model_fields)
            if key in sub.model_fields:
                exact.append(path + key)
            else:
                close += [path + c for c in difflib.get_close_matches(key, fields, 1, 0.8)]
            deeper = nested_key_paths(sub, key, path)
            exact += [p for p in deeper if p.rsplit(".", 1)[-1] == key]
            close += [p for p in deeper if p.rsplit(".", 1)[-1] != key]
    return sorted(exact, key=len) + sorted(close, key=len)
