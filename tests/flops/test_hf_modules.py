"""FLOPs for every MoE family of the installed transformers, read from the model's modules.

The matrix is discovered (``hf_families.moe_families``), not a hand list. For each family's
own tiny model (``hf_families``):

- the estimate read from the modules (``causal=False``) equals ``FlopCounterMode`` on one
  training step (forward + backward) exactly, once the kernels the counter gets wrong are
  counted alone and taken out of both sides (``flops_counting``: depthwise-conv backward,
  chunked linear-attention and state-space scans, inline kernels) and the named exceptions of
  :data:`ADJUSTMENTS` are applied, each saying why;
- those kernels' components equal the recurrent-equivalent formulas of their modules' sizes;
- the causal estimate's attention core equals the pairs the attention masks the model builds
  actually keep (sliding windows, chunks, sparse top-k, compressed keys), measured at the
  eager attention function;
- a config without a model (a ``PretrainedConfig`` or a config.json dict) costs the same
  through ``get_flops_estimator`` (a meta-device skeleton), and for the registered families the
  module-derived shape equals the registry's formula (two independent derivations).

:func:`flops_support` tells the supported-models table, per family, whether FLOPs are
supported and what to note.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

transformers = pytest.importorskip("transformers")

from flops_counting import StepCount, count_training_step  # noqa: E402
from hf_families import family, moe_families, shared_tiny_model, tiny_config  # noqa: E402

from nemo_moe_metrics.flops import (  # noqa: E402
    fixture_names,
    get_flops_estimator,
    load_fixture,
    registered_model_types,
)
from nemo_moe_metrics.flops.hf_modules import (  # noqa: E402
    estimator_from_model,
    meta_model,
)

MODEL_TYPES = [f.model_type for f in moe_families()]

pytestmark = pytest.mark.usefixtures("one_thread")

# One training step over two sequences. Odd, unequal lengths: no window, chunk or compression
# rate of the tiny configs divides them, so partial blocks are exercised.
LENGTHS = [17, 26]

#: The training step counted under FlopCounterMode: one sequence (per-sequence accounting of
#: packed batches is checked in flops/test_core.py and flops/test_components.py).
STEP = [26]

#: Families whose FLOPs cannot be estimated, with the reason. None today.
UNSUPPORTED: dict[str, str] = {}

_DSA = "DSA indexer: forward only (only its top-k positions leave it); attention window index_topk"

#: Vision-language models: the estimate costs the tokens the language model runs (image tokens
#: included, as tokens), not the encoders that make the image tokens.
_VLM = "language model only: the vision encoder and its projector are not counted"

_OMNI = "language model only: the vision and audio encoders and their projectors are not counted"

#: What the supported-models table notes per family (registered types use their formula).
FLOPS_NOTES: dict[str, str] = {
    "axk2": _DSA,
    "bailing_hybrid": "Kimi Delta Attention layers: recurrent-equivalent, as Gated DeltaNet",
    "dbrx": "experts stored as a 2-D GLU (w1, v1, w2), not transformers' experts interface",
    "deepseek_ocr2": _VLM,
    "deepseek_v32": _DSA,
    "deepseek_v4": (
        "compressed attention (CSA, HCA) over one key per compress_rate tokens, its indexer "
        "forward only; hyper-connections"
    ),
    "doge": "product-key experts: 2 x hidden multiply-adds per picked expert; top-k attention keys",
    "dots3_note_text": _DSA,
    "ernie4_5_vl_moe": (
        _VLM
        + "; modality-isolated experts: every token is costed with the text experts (text_moe, "
        "moe_intermediate_size[0]); an image or video token runs the vision experts instead "
        "(same top_k, moe_intermediate_size[1]: 512 wide against 1536 by default), which the "
        "estimate does not tell apart"
    ),
    "gemma4_text": "per-layer input projections; a dense MLP beside the MoE block",
    "glm4v_moe": _VLM,
    "glm5_next": (
        _VLM + "; DSA indexer over pools of index_kpool keys, forward only; attention window "
        "index_topk keys in whole pools plus the query's incomplete pool; Kimi Delta Attention "
        "layers: recurrent-equivalent, as Gated DeltaNet; hyper-connections"
    ),
    "glm_moe_dsa": _DSA,
    "granitemoehybrid": "Mamba-2 layers (SSD scan, recurrent-equivalent)",
    "hy_v4": _DSA + "; hyper-connections",
    "hy_v4_vl": _VLM + "; " + _DSA + "; hyper-connections",
    "inkling2_loop_text": (
        "looped layers counted once per pass (with their message gates); attention residuals "
        "over block states; relative position logits; dynamic short convolutions"
    ),
    "inkling2_text": (
        "attention residuals over block states; relative position logits; dynamic short "
        "convolutions"
    ),
    "inkling_text": "relative position logits; short convolutions on keys, values and residuals",
    "jamba": "Mamba-1 layers: 2 x d_inner x d_state multiply-adds per token (recurrent)",
    "jetmoe": "attention experts (MoA): top_k of num_experts query/output projections",
    "kimi_linear": "Kimi Delta Attention layers: recurrent-equivalent, as Gated DeltaNet",
    "kolibri1_1": (
        "weightless indexer on the first query heads, forward only; window index_topk + local + "
        "sink tokens; its pool selection (block summaries) is not counted"
    ),
    "lara_mini": "Gated DeltaNet layers (recurrent-equivalent)",
    "lfm2_moe": "gated short-convolution layers",
    "llama4_text": (
        "top_k experts per token (transformers' implementation runs every expert); chunked "
        "attention"
    ),
    "longcat_flash": (
        "zero-computation experts: transformers runs those picks through real experts with "
        "weight 0, counted as executed (top_k experts)"
    ),
    "minimax": "lightning attention: recurrent-equivalent, 2 state-sized multiply-adds per head",
    "mistral_large4": _VLM + "; " + _DSA,
    "muse_spark": _OMNI,
    "nemotron_h": "Mamba-2 layers (SSD scan, recurrent-equivalent)",
    "qwen3_omni_moe_thinker": _OMNI,
    "qwen3_vl_moe": _VLM,
    "qwen4_exp_text": (
        "QSA indexer over key blocks, forward only; attention window indexer_budget; "
        "hyper-connections and n-gram embeddings"
    ),
    "step3p7": _VLM,
    "unlimited_ocr": (
        _VLM + "; reference sliding-window attention: full causal attention in training (its "
        "window applies to decoded tokens only)"
    ),
    "zaya": (
        "convolutional q/k projections (CCA); the delayed-value projection of one zero token per "
        "sequence is not counted"
    ),
}


def flops_support(model_type: str) -> tuple[bool, str]:
    """(FLOPs supported, note) for the supported-models table; registered types say so."""
    if model_type in UNSUPPORTED:
        return False, UNSUPPORTED[model_type]
    note = FLOPS_NOTES.get(model_type, "")
    if _registered(model_type):
        note = "registered formula" + (f"; {note}" if note else "")
    return True, note


def _registered(model_type: str) -> bool:
    registered = set(registered_model_types())
    return model_type in registered or model_type.removesuffix("_text") in registered


def flops_model(model_type: str) -> Any:
    """The family's shared tiny model."""
    return shared_tiny_model(model_type)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- named exceptions ---------------------------------------------------------------------


Adjustment = Callable[[Any, StepCount, Any], tuple[float, float]]


def _every_expert(model: Any, step: StepCount, estimate: Any) -> tuple[float, float]:
    """transformers' Llama 4 runs every token through every expert (the unpicked ones with
    weight 0); the estimate counts the top_k the algorithm needs: scale it up to compare."""
    config = model.config.get_text_config()
    extra = config.num_local_experts / config.num_experts_per_tok - 1
    return extra * estimate.by_component["routed_experts"], 0.0


def _indexer_head_weighting(model: Any, step: StepCount, estimate: Any) -> tuple[float, float]:
    """DeepSeek-V4's indexer weights its per-head scores element-wise (the counter sees no
    matmul; the estimate counts that multiply-add): one forward multiply-add per head and
    scored (query, compressed key) pair."""
    macs = 0
    for module in model.modules():
        if type(module).__name__.endswith("V4Indexer"):
            rate = module.compress_rate
            macs += sum(module.num_heads * n * (n // rate) for n in STEP)
    return -2.0 * macs, 0.0


def _zero_token_value(model: Any, step: StepCount, estimate: Any) -> tuple[float, float]:
    """ZAYA also runs its delayed-value projection on one zero token per sequence (the initial
    state), forward plus the weight gradient; the estimate counts tokens."""
    per_sequence = sum(
        4 * m.v_proj_delayed.weight.numel()
        for m in model.modules()
        if type(m).__name__.endswith("CCAProjection")
    )
    return 0.0, -per_sequence * len(STEP)


ADJUSTMENTS: dict[str, Adjustment] = {
    "llama4_text": _every_expert,
    "deepseek_v4": _indexer_head_weighting,
    "zaya": _zero_token_value,
}


@contextlib.contextmanager
def _dynamic_conv_taps(model: Any) -> Iterator[list[float]]:
    """Inkling 2's dynamic short convolutions multiply each window by per-token taps
    element-wise: real multiply-adds (channels x kernel per token, counted by the estimate) that
    the counter does not see. Their training FLOPs, per call, from forward hooks."""
    total = [0.0]
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("DynamicShortConvolution"):
            size = module.static_weight.numel()

            def hook(mod, args, out, size=size):
                total[0] += 6.0 * size * args[0].shape[1]

            handles.append(module.register_forward_hook(hook))
    try:
        yield total
    finally:
        for handle in handles:
            handle.remove()


def _expected_and_counted(model_type: str) -> tuple[float, float]:
    model = flops_model(model_type)
    estimate = estimator_from_model(model)(STEP, causal=False)
    with _dynamic_conv_taps(model) as taps:
        step = count_training_step(model, STEP)
    expected = estimate.total - taps[0]
    # Kernels counted alone on the counter's side: their components leave the estimate (which
    # must have them: a kernel the step ran is never costed as zero).
    for component in {c for call in step.calls for c in call.components}:
        assert estimate.by_component.get(component, 0.0) > 0, (model_type, component)
        expected -= estimate.by_component[component]
    # 1-D convolutions: the estimate counts weight elements per token, x 3 for training.
    expected -= sum(6.0 * c.conv_weight.numel() * c.tokens for c in step.calls if not c.components)
    counted = step.rest
    if model_type in ADJUSTMENTS:
        extra_expected, extra_counted = ADJUSTMENTS[model_type](model, step, estimate)
        expected += extra_expected
        counted += extra_counted
    return expected, counted


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_noncausal_estimate_equals_flop_counter(model_type):
    expected, counted = _expected_and_counted(model_type)
    assert counted > 0
    assert expected == pytest.approx(counted, rel=1e-9), model_type


# ---- configs without a model; registered formulas --------------------------------------------


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if not _registered(t)])
def test_a_config_without_a_model_costs_the_same(model_type):
    # Registered types use their formula: compared with the modules in the next test.
    model = flops_model(model_type)
    built = estimator_from_model(model)
    configs = [model.config]
    text = model.config.get_text_config()
    if text is not model.config:  # a vision-language model: its text config alone too
        configs.append(text)
    estimators = []
    for config in configs:
        estimators.append(get_flops_estimator(config))  # a skeleton on the meta device
        estimators.append(get_flops_estimator(json.loads(config.to_json_string(use_diff=False))))
    for causal in (True, False):
        want = built(LENGTHS, causal=causal).total
        for from_config in estimators:
            assert from_config(LENGTHS, causal=causal).total == pytest.approx(want, rel=1e-12)


def _registered_families() -> list[str]:
    return [t for t in MODEL_TYPES if _registered(t)]


@pytest.mark.parametrize("model_type", _registered_families())
def test_registered_formula_equals_the_shape_read_from_the_modules(model_type):
    model = flops_model(model_type)
    from_modules = estimator_from_model(model)
    formula = get_flops_estimator(model.config)
    for lengths in (LENGTHS, [4096, 100]):
        for causal in (True, False):
            got = from_modules(lengths, causal=causal).by_component
            want = formula(lengths, causal=causal).by_component
            assert got == pytest.approx(want, rel=1e-12), (lengths, causal)


@pytest.mark.parametrize("name", fixture_names())
def test_shipped_real_configs_formula_equals_the_meta_skeleton(name):
    # Real sizes (Qwen3-235B, DeepSeek-V3, gpt-oss's windows, ...) built on the meta device.
    config = load_fixture(name)
    formula = get_flops_estimator(config)
    skeleton = estimator_from_model(meta_model(transformers.AutoConfig.for_model(**config)))
    for causal in (True, False):
        got = skeleton([32768, 4096, 100], causal=causal).by_component
        want = formula([32768, 4096, 100], causal=causal).by_component
        assert got == pytest.approx(want, rel=1e-12), causal
    assert skeleton.parameter_counts() == formula.parameter_counts()


@pytest.mark.parametrize("model_type", ["gemma4", "llama4", "inkling2"])
def test_a_multimodal_model_costs_its_text_decoder(model_type):
    # Attaching a vision-language model reads the same text decoder as its causal LM; vision
    # and audio towers are not counted.
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = transformers.AutoConfig.for_model(model_type)  # full size, on the meta device
    model_class = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        multimodal = model_class._from_config(config)
    for causal in (True, False):
        got = estimator_from_model(multimodal)([4096, 100], causal=causal).by_component
        want = estimator_from_model(meta_model(config))([4096, 100], causal=causal).by_component
        assert got == pytest.approx(want, rel=1e-12)


def test_a_model_with_partitioned_weights_is_costed_from_its_config():
    # DeepSpeed ZeRO-3 and FSDP1 flat parameters leave empty weights on the modules.
    model = family("glm4_moe").model_class(tiny_config("glm4_moe"))
    want = estimator_from_model(model)(LENGTHS).total
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(torch.empty(0))
    assert get_flops_estimator(model.config, model=model)(LENGTHS).total == want


def test_attach_reads_flops_from_the_attached_model():
    from nemo_moe_metrics.config import MetricsConfig
    from nemo_moe_metrics.export import metric_names as mn
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    model = flops_model("glm4_moe")  # no formula registered
    assert not _registered("glm4_moe")
    metrics = PolicyMetrics(MetricsConfig(track_throughput=True, track_flops=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "FLOP metrics disabled"
        metrics.attach(model, model.config)
    with metrics.step():
        metrics.microbatch(torch.tensor(LENGTHS))
    out = metrics.finish_step(num_microbatches=1)
    want = estimator_from_model(model)(LENGTHS).total
    assert out[mn.ESTIMATED_FLOPS] == pytest.approx(want, rel=1e-12)


def test_cli_flops_reads_a_model_directory_of_any_family(tmp_path, capsys):
    from nemo_moe_metrics.cli import main

    config = tiny_config("minimax")
    config.save_pretrained(tmp_path)
    assert main(["flops", "--config", str(tmp_path), "--seq-lens", "17", "26", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = estimator_from_model(meta_model(config))(LENGTHS)
    assert got["total"] == pytest.approx(want.total, rel=1e-12)
    assert got["by_component"]["linear_attention_core"] > 0


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "ernie4_5_vl_moe"])
def test_cli_flops_reads_a_vision_language_model_directory(model_type, tmp_path, capsys):
    # No causal LM in transformers: the config.json of the whole model, as published.
    from nemo_moe_metrics.cli import main

    config = tiny_config(model_type)
    config.save_pretrained(tmp_path)
    assert main(["flops", "--config", str(tmp_path), "--seq-lens", "17", "26", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = family(model_type).model_class._from_config(config)
    want = estimator_from_model(model)(LENGTHS)
    assert got["total"] == pytest.approx(want.total, rel=1e-12)
    assert got["by_component"] == pytest.approx(want.by_component, rel=1e-12)


def test_every_family_is_supported_or_says_why():
    for model_type in MODEL_TYPES:
        supported, note = flops_support(model_type)
        assert supported or note, model_type
    assert not set(UNSUPPORTED) - set(MODEL_TYPES)
    assert not set(FLOPS_NOTES) - set(MODEL_TYPES), "a note for a family that is gone"
