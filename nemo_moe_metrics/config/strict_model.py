"""The strict base of every config model, and how its errors are worded.

:class:`StrictModel` rejects unknown keys with a "did you mean" suggestion and a true/false
value where a field takes none; built from Python, a bad value raises :class:`ConfigError` with
one ``key: problem`` line per error. :func:`recipe_error_text` words a recipe's errors, naming the
override that brought a problem in. The models themselves live in ``config.py``.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from nemo_moe_metrics.config.key_suggestions import nested_key_paths


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the key and the fix."""


class _ConfigErrors(type(BaseModel)):
    """Constructing a model from Python (``MetricsConfig(...)``) raises :class:`ConfigError`
    instead of pydantic's ValidationError. A metaclass, not ``__init__``: pydantic calls a
    model's own ``__init__`` when it validates it as a nested field, and would wrap the error."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as err:
            raise ConfigError(_api_error_text(cls.__name__, err)) from None


class StrictModel(BaseModel, metaclass=_ConfigErrors):
    """Base model: unknown keys are rejected with a 'did you mean' suggestion; built from
    Python (``MetricsConfig(...)``, ``model_validate``), a bad value raises :class:`ConfigError`
    with one line per problem (pydantic's own error adds a documentation link to each)."""

    # allow_inf_nan=False: an infinite peak or coefficient passes "> 0" and poisons every rate.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # True where the caller words the errors itself (the recipe: recipe_from_dict).
    words_its_own_errors: ClassVar[bool] = False

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        """pydantic's ``model_validate``, raising :class:`ConfigError` as the constructor does."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as err:
            if cls.words_its_own_errors:
                raise
            raise ConfigError(_api_error_text(cls.__name__, err)) from None

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        foreign = getattr(cls, "foreign_keys", {})
        for key in data:
            if key in foreign:
                raise ValueError(f"unknown key '{key}': {foreign[key]}")
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                # Not a typo here, but a key of a section below (given without its section)?
                close = close or nested_key_paths(cls, str(key))[:1]
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"unknown key '{key}'{hint} (valid keys: {', '.join(sorted(known))})"
                )
            # Lax pydantic reads true as 1: `num_layers: true` would silently build one layer.
            if isinstance(data[key], bool) and not _allows_bool(cls.model_fields[key].annotation):
                raise ValueError(f"{key} takes no true/false value, got {str(data[key]).lower()}")
        return data


def _api_error_text(model: str, err: ValidationError) -> str:
    """``invalid MetricsConfig:`` then one ``  key: problem`` line per error."""
    lines = [f"invalid {model}:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}" if where else f"  {msg}")
    return "\n".join(lines)


def _allows_bool(annotation: Any) -> bool:
    """Whether a field's type accepts a bool as itself (bool, or a union or list with bool)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_allows_bool(arg) for arg in get_args(annotation))


def recipe_error_text(
    err: ValidationError,
    source: str,
    overrides: list[str] | None = None,
    file_errors: set[tuple[tuple[Any, ...], str]] | None = None,
) -> str:
    """One line per problem; a problem an override brought in is named after that override.

    ``file_errors`` are the (location, message) pairs the file has without any override: those
    stay the file's, whatever the overrides touch.
    """
    by_key = {item.partition("=")[0].strip(): item for item in overrides or []}
    file_errors = file_errors or set()
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["loc"]:  # a suggested key of a section below: its full dotted path
            msg = re.sub(r"did you mean '(\w+\.[\w.]+)'", rf"did you mean '{where}.\1'", msg)
        if e["type"] == "missing":
            msg = (
                f"section or key '{where}' is missing; add it to the recipe (the example recipes "
                "in examples/configs/ show every section)"
            )
        culprit = None
        if (tuple(e["loc"]), e["msg"]) not in file_errors:
            # The override that set this key, or one inside the section the problem is at;
            # an unknown key at the top level has no location: match it by its own name.
            unknown = re.match(r"unknown key '([^']+)'", msg)
            named = unknown and by_key.get(f"{where}." * bool(e["loc"]) + unknown.group(1))
            culprit = (
                named
                or by_key.get(where)
                or next((item for key, item in by_key.items() if key.startswith(where + ".")), None)
            )
        lines.append(f"  override '{culprit}': {msg}" if culprit else f"  {where}: {msg}")
    only_overrides = all(line.startswith("  override '") for line in lines)
    header = (
        f"invalid override for recipe {source}:" if only_overrides else f"invalid recipe {source}:"
    )
    return "\n".join([header, *lines])
