"""The module walk of a transformers model (flops/hf_module_tree.py): each decoder layer once."""

from __future__ import annotations

import warnings

import pytest

from tests.flops.test_hf_modules import flops_model

torch = pytest.importorskip("torch")

transformers = pytest.importorskip("transformers")

from nemo_moe_metrics.flops.hf_modules import (  # noqa: E402
    model_shape,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_model_shape_walks_each_decoder_layer_once():
    model = flops_model("gemma4_text")
    shape = model_shape(model)
    config = model.config.get_text_config()
    # gemma4: attention + dense MLP, and the MoE block beside it, in every layer.
    assert sum(layer.mixer is not None for layer in shape.layers) == config.num_hidden_layers
    assert sum(layer.ffn is not None for layer in shape.layers) == 2 * config.num_hidden_layers
