"""Which layers are MoE (config/layer_pattern.py): a hybrid pattern and num_layers agree, pipe
symbols are not layers, MTP is refused, a hybrid config's MoE layers come from its pattern."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.megatron


def test_pattern_and_num_layers_must_agree():
    from nemo_moe_metrics.config import ModelConfig

    with pytest.raises(ValueError, match="set num_layers: 4"):
        ModelConfig(num_layers=3, hybrid_layer_pattern="*E*E")
    with pytest.raises(ValueError, match="remove moe_layer_freq"):
        ModelConfig(num_layers=4, hybrid_layer_pattern="*E*E", moe_layer_freq=2)
    with pytest.raises(ValueError, match="unknown symbols"):
        ModelConfig(num_layers=4, hybrid_layer_pattern="*X*E")


def test_pipe_symbols_are_not_layers_and_mtp_is_refused():
    from nemo_moe_metrics.config.layer_pattern import hybrid_layer_symbols

    assert hybrid_layer_symbols("*E|*E") == ["*", "E", "*", "E"]
    with pytest.raises(ValueError, match="multi-token-prediction"):
        hybrid_layer_symbols("*E*E/*E")


def test_moe_layers_of_a_hybrid_config_come_from_the_pattern():
    from types import SimpleNamespace

    from nemo_moe_metrics.moe.aux_loss import moe_layer_indices

    config = SimpleNamespace(
        num_layers=6, num_moe_experts=8, moe_layer_freq=1, hybrid_layer_pattern="M-E*EE"
    )
    assert moe_layer_indices(config) == [2, 4, 5]
    # Megatron-Bridge's older providers spell it hybrid_override_pattern.
    older = SimpleNamespace(
        num_layers=4, num_moe_experts=8, moe_layer_freq=1, hybrid_override_pattern="E*E-"
    )
    assert moe_layer_indices(older) == [0, 2]
