"""The typed recipe: defaults, typos, contradictions, overrides and a YAML round trip."""

from pathlib import Path

import pytest
import yaml

from nemo_moe_metrics.config import (
    ConfigError,
    MegatronConfig,
    MetricsConfig,
    apply_overrides,
    dump_recipe,
    load_recipe,
    recipe_from_dict,
)

# CLI, report, config and Hugging Face checks: the same on every megatron-core line
# (tests/conftest.py), so CI runs them on one line.
pytestmark = pytest.mark.one_line

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))


def test_metric_flags_default_off():
    cfg = MetricsConfig()
    assert (cfg.track_moe_metrics, cfg.moe_per_layer_logging, cfg.track_flops) == (
        False,
        False,
        False,
    )
    assert cfg.peak_flops_per_gpu is None


def test_per_layer_logging_without_moe_metrics_is_a_contradiction():
    with pytest.raises(ValueError, match="moe_per_layer_logging: true needs track_moe_metrics"):
        MetricsConfig(moe_per_layer_logging=True)


def test_flops_without_throughput_is_a_contradiction():
    with pytest.raises(ConfigError, match="track_flops: true needs track_throughput"):
        recipe_from_dict({"policy": {"megatron_cfg": {"track_flops": True}}})


def test_non_positive_peak_is_rejected():
    with pytest.raises(ValueError, match="peak_flops_per_gpu"):
        MetricsConfig(peak_flops_per_gpu=0)


def test_dotted_overrides_apply_and_parse_yaml_values():
    data = apply_overrides(
        {"policy": {"megatron_cfg": {"track_flops": False}}},
        ["policy.megatron_cfg.track_flops=true", "training.max_steps=3", "name=x"],
    )
    assert data["policy"]["megatron_cfg"]["track_flops"] is True
    assert data["training"]["max_steps"] == 3
    assert data["name"] == "x"


@pytest.mark.parametrize("bad", ["novalue", "=3", "name.sub=1"])
def test_malformed_override_is_explained(bad):
    with pytest.raises(ConfigError, match="override"):
        apply_overrides({"name": "a"}, [bad])


def test_override_typo_is_caught(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: t\n")
    with pytest.raises(ConfigError, match="did you mean 'track_flops'"):
        load_recipe(path, ["policy.megatron_cfg.track_flop=true"])


def test_megatron_cfg_exposes_metric_flags_alone():
    cfg = MegatronConfig(track_moe_metrics=True, expert_model_parallel_size=2)
    metrics = cfg.metrics()
    assert type(metrics) is MetricsConfig
    assert metrics.track_moe_metrics is True


def test_moe_layer_freq_length_must_match_layers():
    with pytest.raises(ConfigError, match="moe_layer_freq has 2 entries"):
        recipe_from_dict({"policy": {"model": {"num_layers": 4, "moe_layer_freq": [0, 1]}}})


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_three_example_recipes_exist():
    assert {p.name for p in RECIPES} >= {
        "sft_moe_tiny.yaml",
        "dpo_moe_tiny.yaml",
        "grpo_moe_tiny.yaml",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_example_recipe_is_valid_and_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    model = recipe.policy.model
    # The tiny model must give later metrics something real to measure.
    assert model.moe_layer_pattern()[0] == 0, "first layer should be dense"
    assert sum(model.moe_layer_pattern()) >= 2
    assert model.num_experts >= 4 and model.moe_router_topk > 1
    assert model.moe_aux_loss_coeff > 0 and model.moe_z_loss_coeff
    assert recipe.algorithm in path.name
    copy = tmp_path / "copy.yaml"
    copy.write_text(dump_recipe(recipe))
    assert load_recipe(copy) == recipe
    # Every flag is documented inline in the example.
    text = path.read_text()
    for flag in MetricsConfig.model_fields:
        assert f"{flag}:" in text and "#" in text.split(f"{flag}:")[1].splitlines()[0], flag
    assert isinstance(yaml.safe_load(text), dict)


# --- issue 52: a recipe's input errors, one line each, through `check` -------------------------


_TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"


def _check_error(capsys, argv: list[str]) -> str:
    from nemo_moe_metrics.cli import main

    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Input should be" not in err, err
    return err


def test_a_key_given_twice_in_a_recipe_is_named_with_both_lines(tmp_path, capsys):
    recipe = tmp_path / "dup.yaml"
    text = _TINY.read_text()
    recipe.write_text(text + "\nname: other\n")
    first = 1 + text.splitlines().index(
        next(ln for ln in text.splitlines() if ln.startswith("name:"))
    )
    last = len(text.splitlines()) + 2
    err = _check_error(capsys, [str(recipe)])
    assert f"key 'name' appears twice in one mapping (lines {first} and {last})" in err, err
    assert str(recipe) in err and len(err.strip().splitlines()) == 1


def test_a_recipe_that_is_not_utf8_is_named_with_the_byte_and_line(tmp_path, capsys):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(_TINY.read_bytes() + "# r\xe9sum\xe9\n".encode("latin-1"))
    lines = len(_TINY.read_bytes().splitlines()) + 1
    err = _check_error(capsys, [str(recipe)])
    assert f"recipe {recipe} is not UTF-8 text: byte 0xe9 on line {lines}" in err, err


def test_an_empty_name_override_says_what_an_empty_name_is(capsys):
    err = _check_error(capsys, [str(_TINY), "name="])
    assert "override 'name=': '' names no directory of its own" in err, err
