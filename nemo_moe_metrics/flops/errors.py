"""The FLOP estimator's error types, below both the registry and the module reader.

:class:`UnknownModelTypeError` (a ``ValueError``): no estimator for a model. Its two
subclasses say why the module reader (:mod:`nemo_moe_metrics.flops.hf_modules`) could not
provide one: a module no rule knows, or a model type the installed transformers lacks.
"""

from __future__ import annotations


class UnknownModelTypeError(ValueError):
    """No FLOP formula is registered for the config's model_type."""


class UnsupportedModelError(UnknownModelTypeError):
    """The model holds a module whose FLOPs no rule of :mod:`hf_modules` knows."""


class NotInTransformersError(UnknownModelTypeError):
    """The installed transformers has no causal LM (nor image-text-to-text model) for the
    config's model_type."""


__all__ = ["NotInTransformersError", "UnknownModelTypeError", "UnsupportedModelError"]
