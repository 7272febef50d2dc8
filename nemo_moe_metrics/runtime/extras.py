"""Optional dependencies ("extras") and the error a missing one gives.

The core install (``pip install nemo_moe_metrics``) is the metric library: torch, numpy, pydantic
and pyyaml. Everything heavier is an extra of the package, named in ``pyproject.toml``:

- ``megatron``: megatron-core (reference policy worker, aux-loss tracker, CPU demo);
- ``launch``: nemo-run (with its leptonai pin), rich and Ray, for ``nemo-moe-metrics run`` (its
  ``--engine ray`` too) and Slurm;
- ``wandb``, ``tensorboard``: those sinks; ``report``: matplotlib for the pictures;
- ``html``: vl-convert-python, whose Vega runtime ``report --html`` inlines into its page;
- ``hf``: transformers, for Hugging Face models (``examples/integrate_hf_fsdp.py``);
- ``torchtitan``: torchtitan 0.3.0 models (``examples/integrate_torchtitan.py``): not an extra
  of the package, because torchtitan's own pins (``datasets<4.8``) downgrade huggingface_hub
  under transformers 5; it installs with :data:`TORCHTITAN_INSTALL`, everywhere the same line;
- ``mlflow``: mlflow-skinny with SQLAlchemy and Alembic, for the MLflow sink's SQLite store;
- ``trl``: TRL (with accelerate and datasets) and transformers, for ``MoEMetricsCallback`` in
  TRL's trainers (``examples/integrate_trl.py``); ``trackio``: the trackio sink;
- ``all``: every one of them.

A module that needs an extra imports it through :func:`require`, so a missing one fails with
the install command instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# The top-level module each extra provides (what is looked for), by extra name.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "megatron": ("megatron.core",),
    "launch": ("nemo_run", "rich", "ray"),
    "wandb": ("wandb",),
    "tensorboard": ("tensorboard",),
    "report": ("matplotlib",),
    "html": ("vl_convert",),
    "hf": ("transformers",),
    "torchtitan": ("torchtitan",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "trl": ("trl", "accelerate", "datasets"),
    "trackio": ("trackio",),
}


#: The one way torchtitan 0.3.0 is installed (README, docs, the example, this error, CI):
#: without its own dependencies, whose pins would break transformers, plus what it imports.
TORCHTITAN_INSTALL = (
    "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 "
    "einops==0.8.2 && pip install tyro==1.0.17 triton==3.7.1"
)
# Dependency groups installed by a command of their own instead of an extra.
_INSTALL_COMMANDS = {"torchtitan": TORCHTITAN_INSTALL}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra``."""
    return _INSTALL_COMMANDS.get(extra, f"pip install 'nemo_moe_metrics[{extra}]'")


def missing_extra_message(module: str, extra: str, what: str) -> str:
    """The one message every missing-extra error uses."""
    hint = install_hint(extra)
    if extra in _INSTALL_COMMANDS:
        return (
            f"{what} needs {extra} ({module} is not installed); install it with: {hint} "
            "(no extra: its own pins would break transformers; docs/en/torchtitan.md)"
        )
    return f"{what} needs the '{extra}' extra ({module} is not installed); install it with: {hint}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed (empty when the extra is complete)."""
    return [m for m in EXTRA_MODULES[extra] if not _installed(m)]


def check_extra(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` when ``extra`` is not fully installed (imports nothing)."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(missing_extra_message(missing[0], extra, what))


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``; when it is missing, raise :class:`MissingExtraError` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        # Only a missing module of this extra; an import error inside it is a real bug to show.
        root = module.split(".")[0]
        if err.name is None or err.name.split(".")[0] != root:
            raise
        raise MissingExtraError(missing_extra_message(module, extra, what)) from err
