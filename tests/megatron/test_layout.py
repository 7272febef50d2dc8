"""The model decides: megatron-core's own hybrid model, built WITHOUT our builder, attached with a
plain TransformerConfig (no pattern on it), as docs/en/integration.md says.

megatron-core 0.19 builds a ``HybridModel``, 0.16 a ``MambaModel``; the pattern goes to the model
constructor only. Expected values come from megatron's own report (with the MoE layers written
down by hand from the pattern) and from ``FlopCounterMode`` on the same step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import ok_values, run_ranks

from nemo_moe_metrics.export.metric_names import aux_loss_key, aux_loss_layer_key
from tests.moe.test_aux_loss import assert_equals_megatrons_report, megatron_report_of

pytestmark = pytest.mark.megatron

PATTERN = "*E*E"
MOE_FREQ = [0, 1, 0, 1]  # by hand: the E positions of PATTERN
BATCH, SEQ, VOCAB = 2, 16, 64


def _plain_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=len(PATTERN),
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )


def _megatron_hybrid_step(rank, world_size):
    from torch.utils.flop_counter import FlopCounterMode

    from nemo_moe_metrics.config import MegatronConfig, MetricsConfig
    from nemo_moe_metrics.config.layer_pattern import config_hybrid_pattern
    from nemo_moe_metrics.families.throughput import Throughput
    from nemo_moe_metrics.flops import get_flops_estimator
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.model import causal_attention_mask, init_distributed
    from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

    init_distributed(MegatronConfig())
    compat.reset_tracker()
    torch.manual_seed(0)
    config = _plain_config()
    model_cls, spec_kw, pattern_kw = compat.hybrid_model_class()
    # megatron's own constructor; only the spec is local (megatron's stock one needs TE).
    model = model_cls(
        config=config,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        **{spec_kw: compat.local_hybrid_stack_spec(config.num_moe_experts), pattern_kw: PATTERN},
    )
    out: dict = {"model_class": model_cls.__name__, "config_has_pattern": False}
    out["config_has_pattern"] = config_hybrid_pattern(config) is not None
    flags = MetricsConfig(
        track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True, track_flops=True
    )
    metrics = PolicyMetrics(flags, vocab_size=VOCAB)
    metrics.attach([model], config)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = causal_attention_mask(SEQ)
    # A forward with grad outside step() (a probe): megatron's tracker records it, the step not.
    probe = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(probe, pos, mask, labels=probe).mean().backward()
    counter = FlopCounterMode(display=False)
    with metrics.step():
        entry = {k: v.clone() for k, v in compat.tracker_values().items()}
        metrics.microbatch(seq_lens=torch.full((BATCH,), SEQ))
        with counter:
            model(tokens, pos, mask, labels=tokens).mean().backward()
    # The step's own forward: what the tracker gained inside the step.
    before = {k: (v - entry[k]).tolist() for k, v in compat.tracker_values().items()}
    out["metrics"] = metrics.finish_step(num_microbatches=1)
    oracle = copy.copy(config)
    oracle.moe_layer_freq = list(MOE_FREQ)
    out["megatron"] = megatron_report_of(before, oracle, 1)
    out["tracker"] = before
    lengths = [SEQ] * BATCH
    out["counted_flops"] = float(counter.get_total_flops())
    # The counter counts the full T x T attention product: compare the non-causal estimate.
    out["estimate_full_attention"] = (
        metrics.family(Throughput).meter._estimator(lengths, causal=False).total
    )
    out["estimate_plain_config"] = get_flops_estimator(config, vocab_size=VOCAB)(
        lengths, causal=False
    ).total
    # The config and the model disagreeing is an error naming both.
    from nemo_moe_metrics.megatron.layout import config_as_built

    errors = []
    wrong = copy.copy(config)
    wrong.hybrid_layer_pattern = "**EE"
    fewer = copy.copy(config)
    fewer.num_layers = 3
    for bad in (wrong, fewer):
        try:
            config_as_built(model, bad)
        except ValueError as err:
            errors.append(str(err))
    # A GPT layer spec decides which layers hold routers: the local single-layer spec makes every
    # layer MoE, whatever moe_layer_freq says.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    gpt_config = _plain_config()
    gpt_config.moe_layer_freq = [0, 1, 1, 1]
    gpt = GPTModel(
        config=gpt_config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    try:
        config_as_built(gpt, gpt_config)
    except ValueError as err:
        errors.append(str(err))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def hybrid():
    (result,) = ok_values(run_ranks(_megatron_hybrid_step, 1, timeout=240))
    return result


@pytest.mark.timeout(300)
def test_megatron_hybrid_model_built_without_our_builder(hybrid):
    assert hybrid["model_class"] in ("HybridModel", "MambaModel")
    assert not hybrid["config_has_pattern"]  # the user's config stays as it was


@pytest.mark.timeout(300)
def test_megatron_hybrid_aux_losses_equal_megatrons_report_over_moe_layers(hybrid):
    metrics, tracker = hybrid["metrics"], hybrid["tracker"]
    aux = {k: v for k, v in metrics.items() if "loss" in k}
    assert_equals_megatrons_report(aux, hybrid["megatron"])
    lb = tracker["load_balancing_loss"]
    assert [i for i, v in enumerate(lb) if v != 0] == [1, 3]
    mean_moe = (lb[1] + lb[3]) / 2
    assert metrics[aux_loss_key("load_balancing_loss")] == pytest.approx(mean_moe, rel=1e-6)
    # What a mean over all four layers (the config alone) gives: half, so this could fail.
    assert sum(lb) / len(lb) == pytest.approx(0.5 * mean_moe, rel=1e-6)
    assert metrics[aux_loss_key("z_loss")] > 0
    assert metrics["moe/routed_tokens"] == BATCH * SEQ  # the probe outside step() not counted


@pytest.mark.timeout(300)
def test_megatron_hybrid_per_layer_keys_only_for_moe_layers(hybrid):
    metrics = hybrid["metrics"]
    for name in ("load_balancing_loss", "z_loss"):
        assert [i for i in range(4) if aux_loss_layer_key(name, i) in metrics] == [1, 3]
    assert [i for i in range(4) if f"moe/layer_{i}/max_over_ideal" in metrics] == [1, 3]


@pytest.mark.timeout(300)
def test_megatron_hybrid_flops_follow_the_models_layers(hybrid):
    counted = hybrid["counted_flops"]
    assert hybrid["estimate_full_attention"] == pytest.approx(counted, rel=0.005)
    assert hybrid["estimate_plain_config"] > 1.5 * counted  # every layer attention + MoE
    assert 0 < hybrid["metrics"]["train_perf/estimated_flops"] < hybrid["estimate_full_attention"]


@pytest.mark.timeout(300)
def test_megatron_config_that_contradicts_the_model_is_an_error_naming_both(hybrid):
    pattern_error, layers_error, gpt_error = hybrid["errors"]
    assert "'**EE'" in pattern_error and f"'{PATTERN}'" in pattern_error
    assert "num_layers=3" in layers_error and f"'{PATTERN}'" in layers_error
    assert "moe_layer_freq=[0, 1, 1, 1]" in gpt_error and "routers in [0, 1, 2, 3]" in gpt_error
