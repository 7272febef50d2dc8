"""Hardening, single process: recipe loader properties, odd data, and sinks that fail mid-run.

Cases already covered elsewhere are not repeated here (typo suggestions:
config/test_strict_model.py; NaN aux losses: moe/test_aux_loss.py; failed steps: test_train.py,
throughput/test_step_meter*.py; W&B unavailable and JSONL SIGKILL: sinks/test_wandb.py,
sinks/test_jsonl.py). Distributed cases: e2e/test_hardening_dist.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_moe_metrics.config import (
    ConfigError,
    LoggerConfig,
    MetricsConfig,
    Recipe,
    apply_overrides,
    dump_recipe,
    recipe_from_dict,
)
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.flops import get_flops_estimator
from nemo_moe_metrics.sinks import METRICS_FILE, TENSORBOARD_DIR, build_sinks
from nemo_moe_metrics.sinks.base import MultiSink, SinkWriteError
from nemo_moe_metrics.sinks.jsonl import JsonlSink
from nemo_moe_metrics.throughput import StepMeter
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

pytestmark = pytest.mark.megatron

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_moe_tiny.yaml"
BASE = yaml.safe_load(EXAMPLE.read_text())


# ----------------------------------------------------------------------------- recipe loader


def _leaf_paths(model: type, prefix: str = "") -> list[str]:
    """Every dotted path to a leaf field of the recipe, from the pydantic schema itself."""
    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_paths(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


LEAVES = _leaf_paths(Recipe)
# YAML scalars of every kind an override can carry, written as the user would type them.
YAML_VALUES = st.one_of(
    st.sampled_from(
        ["true", "false", "null", "0", "-1", "1", "3", "1e3", "0.5", "inf", ".nan", "[]", "{}"]
    ),
    st.sampled_from(["[0, 1, 1, 1]", "full", "aux_loss", "'x'", "[", "{a: 1", ": :", "a=b"]),
    st.integers(-(2**70), 2**70).map(str),
    st.text(max_size=12).filter(lambda t: "\n" not in t and "\r" not in t),
)


def test_recipe_paths_cover_the_metric_flags():
    # Guards the property tests below: they must really reach the flags users override.
    assert {f"policy.megatron_cfg.{f}" for f in MetricsConfig.model_fields} <= set(LEAVES)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(LEAVES), value=YAML_VALUES)
def test_any_override_of_a_real_key_applies_or_names_the_key(path, value):
    try:
        recipe = recipe_from_dict(apply_overrides(BASE, [f"{path}={value}"]))
    except ConfigError as err:
        # The message names the key (a cross-field rule names it without its section path).
        assert path.rsplit(".", 1)[-1] in str(err), str(err)
        return
    # Applied: reading the key back gives the value pydantic made of the YAML value.
    node: object = recipe
    for part in path.split("."):
        node = getattr(node, part)
    parsed = yaml.safe_load(value)
    if isinstance(parsed, bool):
        assert node is parsed
    if isinstance(node, float):
        # inf or NaN would pass "> 0" checks and poison rates (MFU against an infinite peak).
        assert np.isfinite(node), (path, value)
        if isinstance(parsed, int | float):
            assert node == pytest.approx(float(parsed))


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.text(min_size=0, max_size=8).filter(lambda t: "=" not in t), max_size=4),
    value=YAML_VALUES,
)
def test_any_dotted_override_raises_only_config_error(parts, value):
    key = ".".join(parts)
    # Every other exception type fails the test.
    with contextlib.suppress(ConfigError):
        recipe_from_dict(apply_overrides(BASE, [f"{key}={value}"]))


@settings(max_examples=100, deadline=None)
@given(
    flags=st.fixed_dictionaries(
        {f: st.booleans() for f in ("track_moe_metrics", "track_throughput", "log_expert_table")}
    ),
    per_layer=st.booleans(),
    flops=st.booleans(),
    peak=st.one_of(st.none(), st.floats(1e9, 1e16)),
    steps=st.integers(1, 10**6),
)
def test_valid_recipes_round_trip_through_yaml_and_overrides(flags, per_layer, flops, peak, steps):
    flags = dict(flags)
    flags["moe_per_layer_logging"] = per_layer and flags["track_moe_metrics"]
    flags["track_flops"] = flops and flags["track_throughput"]
    flags["peak_flops_per_gpu"] = peak
    overrides = [f"policy.megatron_cfg.{k}={json.dumps(v)}" for k, v in flags.items()]
    overrides.append(f"training.max_steps={steps}")
    recipe = recipe_from_dict(apply_overrides(BASE, overrides))
    assert recipe.policy.megatron_cfg.metrics().model_dump() == {
        **MetricsConfig().model_dump(),
        **flags,
    }
    again = recipe_from_dict(yaml.safe_load(dump_recipe(recipe)))
    assert again == recipe


def test_override_with_invalid_yaml_value_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        apply_overrides(BASE, ["policy.megatron_cfg.track_flops=["])
    assert "'policy.megatron_cfg.track_flops'" in str(err.value)
    assert "not valid YAML" in str(err.value) and "quote it" in str(err.value)


def test_missing_model_section_is_named_instead_of_training_the_demo_model():
    data = yaml.safe_load(EXAMPLE.read_text())
    del data["policy"]["model"]
    with pytest.raises(ConfigError) as err:
        recipe_from_dict(data, source="r.yaml")
    msg = str(err.value)
    assert "invalid recipe r.yaml" in msg
    assert "'policy.model' is missing" in msg and "examples/configs/" in msg


def test_missing_policy_section_is_named():
    with pytest.raises(ConfigError, match="'policy' is missing"):
        recipe_from_dict({"name": "x"})


def test_unknown_top_level_keys_are_all_reported_with_valid_keys():
    data = {**BASE, "trainer": {}, "loggers": {}}
    with pytest.raises(ConfigError) as err:
        recipe_from_dict(data)
    msg = str(err.value)
    assert "unknown key 'trainer'" in msg and "valid keys:" in msg
    assert "did you mean 'training'" in msg


# ----------------------------------------------------------------------------- data edge cases


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )


def _perf_only(cfg_kwargs: dict) -> MetricsConfig:
    return MetricsConfig(track_throughput=True, **cfg_kwargs)


def test_unknown_model_type_for_flops_warns_once_and_emits_no_flop_keys():
    from transformers import PretrainedConfig

    class MysteryConfig(PretrainedConfig):
        model_type = "mystery_moe"

    mystery = MysteryConfig()
    metrics = PolicyMetrics(_perf_only({"track_flops": True, "peak_flops_per_gpu": 1e15}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics.attach(torch.nn.Linear(2, 2), mystery)
        outs = []
        for _ in range(3):
            with metrics.step():
                metrics.microbatch(torch.tensor([5, 7]))
            outs.append(metrics.finish_step(num_microbatches=1))
    flops_warnings = [str(w.message) for w in caught if "FLOP metrics disabled" in str(w.message)]
    assert len(flops_warnings) == 1 and "mystery_moe" in flops_warnings[0]
    flop_keys = {mn.ESTIMATED_FLOPS, mn.ESTIMATED_FLOPS_PER_SECOND, mn.TFLOPS_PER_GPU, mn.MFU}
    flop_keys.add(mn.CUMULATIVE_ESTIMATED_FLOPS_PER_SECOND)
    for out in outs:
        assert not flop_keys & set(out), "no FLOP key, never a reported 0"
        assert out[mn.TOKENS] == 12.0


def test_zero_token_steps_and_empty_microbatches_report_zero_tokens_not_missing_or_nan():
    est = get_flops_estimator(_llama())
    metrics = PolicyMetrics(_perf_only({"track_flops": True}), vocab_size=128)
    metrics.attach(torch.nn.Linear(2, 2), _llama())
    with metrics.step():
        metrics.microbatch(torch.zeros(0, dtype=torch.int64))  # no sequences at all
        metrics.microbatch(torch.tensor([0, 0]))  # sequences of padding only
    empty = metrics.finish_step(num_microbatches=2)
    assert empty[mn.TOKENS] == 0.0 and empty[mn.ESTIMATED_FLOPS] == 0.0
    assert empty[mn.SECONDS] > 0 and empty[mn.TOKENS_PER_SECOND] == 0.0
    with metrics.step():
        metrics.microbatch(torch.zeros(0, dtype=torch.int64))
        metrics.microbatch(torch.tensor([3, 0, 9]))
    after = metrics.finish_step(num_microbatches=2)
    assert after[mn.TOKENS] == 12.0
    assert after[mn.ESTIMATED_FLOPS] == pytest.approx(est(np.array([3, 9])).total, rel=1e-12)
    assert after[mn.TOTAL_TOKENS] == 12.0
    assert all(np.isfinite(v) for v in (*empty.values(), *after.values()))


def test_estimator_treats_a_zero_length_sequence_as_no_work():
    est = get_flops_estimator(_llama())
    n = 1_000_000
    assert est(np.array([0])).total == 0.0
    assert est(np.array([0, n, 0])).total == est(np.array([n])).total
    assert isinstance(est(np.array([n])).total, float)


def test_meter_counts_billions_of_tokens_of_million_token_sequences_exactly():
    est = get_flops_estimator(_llama())
    n, count = 1_000_000, 4096  # 4.1e9 tokens: beyond int32
    lens = torch.tensor([n, 0] * (count // 2), dtype=torch.int32)
    meter = StepMeter(flops_estimator=est)
    with meter.step():
        meter.add_sequences(lens)
        meter.add_sequences(lens)
    out = meter.export()
    assert out[mn.TOKENS] == float(n * count)  # Python ints: the exact count
    exact = est(np.full(count, n, dtype=np.int64)).total
    assert out[mn.ESTIMATED_FLOPS] == pytest.approx(exact, rel=1e-12)
    assert out[mn.ESTIMATED_FLOPS] > 1e18 and np.isfinite(out[mn.ESTIMATED_FLOPS])


# ----------------------------------------------------------------------------- sinks


def _logger(**kw) -> LoggerConfig:
    return LoggerConfig(**{"wandb_enabled": False, **kw})


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a torn line, as readers skip it
            out.append(json.loads(line))
    return out


def test_unwritable_tensorboard_directory_warns_once_and_the_run_keeps_logging(tmp_path):
    # A plain file where the event directory should be: no writer can create files under it
    # (as root, chmod would not stop a write).
    (tmp_path / TENSORBOARD_DIR).write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = build_sinks(_logger(), tmp_path, run_name="r")
        for step in range(3):
            sink.log({mn.TOKENS: step}, step)
        sink.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "TensorBoard sink could not start" in messages[0]
    assert "logger.tensorboard_enabled=false" in messages[0]
    assert [r["step"] for r in _rows(tmp_path / METRICS_FILE)] == [0, 1, 2]


class _FillingDisk:
    """A file object over a real file that accepts ``budget`` more bytes, then fails (ENOSPC).

    Like a real full disk, the write that crosses the limit lands part of its bytes first.
    """

    def __init__(self, real, budget: int) -> None:
        self.real, self.budget = real, budget

    def write(self, text: str) -> int:
        if len(text) > self.budget:
            self.real.write(text[: self.budget])
            self.real.flush()
            self.budget = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= len(text)
        return self.real.write(text)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_disk_full_during_jsonl_write_ends_the_run_naming_the_file_and_keeps_written_steps(
    tmp_path,
):
    # A write that fails as on a full disk (tests/e2e/test_run_faults.py uses a real small tmpfs).
    path = tmp_path / METRICS_FILE
    jsonl = JsonlSink(path)
    line = len(json.dumps({"step": 0, mn.TOKENS: 0.0}, separators=(",", ":"))) + 1
    disk = _FillingDisk(jsonl._file, budget=2 * line + line // 2)  # 2.5 lines fit
    jsonl._file = disk
    other = JsonlSink(tmp_path / "other.jsonl")
    sink = MultiSink([other, jsonl])
    sink.log({mn.TOKENS: 0.0}, 0)
    sink.log({mn.TOKENS: 1.0}, 1)
    with pytest.raises(SinkWriteError) as err:
        sink.log({mn.TOKENS: 2.0}, 2)
    text = str(err.value)
    assert f"cannot write {path}: No space left on device (ENOSPC)" in text
    assert "steps up to 1 are saved" in text and "--resume" in text
    assert err.value.errno == errno.ENOSPC
    # The run is over: the other sink was closed (flushed), later logs are refused.
    assert jsonl._file.closed and other._file.closed
    with pytest.raises(RuntimeError, match="after close"):
        sink.log({mn.TOKENS: 3.0}, 3)
    # What was written stays readable: the two whole lines; the torn third is skipped.
    assert [r["step"] for r in _rows(path)] == [0, 1]
    assert [r["step"] for r in _rows(tmp_path / "other.jsonl")] == [0, 1, 2]
