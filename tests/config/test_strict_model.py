"""The strict base of every config model: an unknown key named with a suggestion, a wrong type
named by its dotted key, and errors worded one line each (no pydantic links)."""

import pytest

from nemo_moe_metrics.config import (
    ConfigError,
    load_recipe,
    recipe_from_dict,
)

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line


def test_misspelt_flag_is_named_with_suggestion(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("policy:\n  megatron_cfg:\n    track_moe_metric: true\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert "policy.megatron_cfg" in msg
    assert "'track_moe_metric'" in msg
    assert "did you mean 'track_moe_metrics'" in msg


def test_misspelt_section_is_named():
    with pytest.raises(ConfigError, match="did you mean 'policy'"):
        recipe_from_dict({"polcy": {}})


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.track_flops"):
        recipe_from_dict({"policy": {"megatron_cfg": {"track_flops": "sometimes"}}})


def test_python_api_config_errors_are_one_line_each_without_pydantic_links():
    from nemo_moe_metrics.config import ConfigError, LoggerConfig, MetricsConfig

    with pytest.raises(ConfigError) as err:
        MetricsConfig(track_flops=True)
    assert str(err.value) == (
        "invalid MetricsConfig:\n  track_flops: true needs track_throughput: true (FLOP/s and "
        "MFU are rates over the measured step time); set track_throughput: true"
    )
    for bad in (
        lambda: LoggerConfig(table_every=0, alerts={"drift": 2}),
        lambda: MetricsConfig.model_validate({"peak_flops_per_gpu": -1}),
    ):
        with pytest.raises(ConfigError) as err:
            bad()
        assert "For further information" not in str(err.value) and "pydantic" not in str(err.value)
    assert (
        str(err.value)
        == "invalid MetricsConfig:\n  peak_flops_per_gpu: Input should be greater than 0"
    )
