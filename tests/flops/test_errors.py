"""The FLOP estimator's errors (flops/errors.py): a module without a rule is named, never costed
as zero; an unknown type still raises with a model."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

transformers = pytest.importorskip("transformers")

from hf_families import family, tiny_config  # noqa: E402

from nemo_moe_metrics.flops import (  # noqa: E402
    UnknownModelTypeError,
    get_flops_estimator,
    try_get_flops_estimator,
)
from nemo_moe_metrics.flops.hf_modules import (  # noqa: E402
    UnsupportedModelError,
    estimator_from_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- errors, attach, CLI --------------------------------------------------------------------


def test_a_module_without_a_rule_is_named_not_costed_as_zero():
    model = tiny_config("glm4_moe")
    model = family("glm4_moe").model_class(model)

    class Mystery(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(4, 64))

    model.model.layers[1].mystery = Mystery()
    with pytest.raises(UnsupportedModelError, match=r"Mystery\.table \(4, 64\)"):
        estimator_from_model(model)
    with pytest.warns(UserWarning, match="FLOP metrics disabled.*Mystery"):
        assert try_get_flops_estimator(model.config, model=model) is None


def test_unknown_type_still_raises_with_a_model():
    class Mystery(transformers.PretrainedConfig):
        model_type = "mystery_moe"

    with pytest.raises(UnknownModelTypeError, match="mystery_moe"):
        get_flops_estimator(Mystery(), model=torch.nn.Linear(2, 2))
