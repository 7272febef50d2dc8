"""Router decision health on every MoE family the installed transformers ships.

The runs are ``test_hf_families``' (one training step per family, router health on, random
expert biases), shared within a session. Per family:

- the scoring the library describes the router with chooses what the router chose (the top-k
  of its selection scores are the indices the router returned, token by token) and follows its
  score function (the router's own weights are proportional to ``f(z)`` over the chosen
  experts): this is what proves the per-family description;
- every ``router_*`` key equals the numpy oracle (``health_oracle``) over the router's own
  logits, its own chosen experts and bias, recorded by the test's hooks;
- the routers that cannot be judged warn once with their reason and log no ``router_*`` key.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from health_oracle import NEAR_TIE_GAP, Layer, Router, assert_matches, expected_keys  # noqa: E402

from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.families.router_health import enable_health  # noqa: E402
from nemo_moe_metrics.moe.router_health import RouterScoring, chosen_experts  # noqa: E402
from tests.adapters.test_hf import BATCH, FAMILIES, SEQ, family_run  # noqa: E402

#: Families with routers that are not a top-k of scores -> the reason their warning gives.
#: phimoe: every layer; deepseek_v4: its hash-routed layers (its other layers are judged).
NOT_JUDGED = {"phimoe": "sparsemixer", "deepseek_v4": "hash routing"}
JUDGED = [f for f in FAMILIES if f != "phimoe"]

_SCORINGS: dict[str, dict[int, RouterScoring | None]] = {}


def _scorings(model_type: str) -> dict[int, RouterScoring | None]:
    """How the library describes each MoE layer's router (None: not judged)."""
    if model_type not in _SCORINGS:
        from nemo_moe_metrics import attach_collector

        collector = attach_collector(family_run(model_type).model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # asserted on the run's own attach
            tracker = enable_health(collector, NEAR_TIE_GAP)
        _SCORINGS[model_type] = {layer: tracker.scoring(layer) for layer in collector.layer_ids}
        collector.detach()
    return _SCORINGS[model_type]


def _oracle_router(s: RouterScoring) -> Router:
    return Router(
        s.score_function, s.num_experts, s.topk, s.num_groups, s.group_topk,
        s.group_score_topk, s.rank_on_logits, s.bias_on_logits, s.group_masked_score,
    )  # fmt: skip


def _scores(z: np.ndarray, score: str) -> np.ndarray:
    z = z.astype(np.float64)
    if score == "softmax":
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)
    return 1 / (1 + np.exp(-z)) if score == "sigmoid" else np.sqrt(np.log1p(np.exp(z)))


@pytest.mark.parametrize("model_type", JUDGED)
def test_the_described_scoring_chooses_what_the_router_chose(model_type):
    run, scorings = family_run(model_type), _scorings(model_type)
    judged = {layer: s for layer, s in scorings.items() if s is not None}
    assert judged and set(judged) <= set(run.seen.decisions), (model_type, sorted(judged))
    for layer, scoring in judged.items():
        for d in run.seen.decisions[layer]:
            bias = None if d.bias is None else torch.from_numpy(d.bias)
            ours = chosen_experts(torch.from_numpy(d.logits), scoring, bias).numpy()
            assert ours.shape == d.chosen.shape, (model_type, layer)
            differ = np.sort(ours, 1) != np.sort(d.chosen, 1)
            assert not differ.any(), f"{model_type} layer {layer}: {differ.any(1).sum()} tokens"
            if d.weights is None or scoring.topk < 2:
                continue
            # The router's weights over its chosen experts are f(z) up to a per-token factor
            # (normalisation, routed scaling): the score function is the router's.
            f = np.take_along_axis(_scores(d.logits, scoring.score_function), d.chosen, 1)
            w = d.weights.astype(np.float64)
            np.testing.assert_allclose(
                w / w.sum(1, keepdims=True),
                f / f.sum(1, keepdims=True),
                rtol=2e-3,
                err_msg=f"{model_type} layer {layer}: weights do not follow {scoring}",
            )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_health_keys_equal_the_oracle_on_the_routers_own_decisions(model_type):
    run, scorings = family_run(model_type), _scorings(model_type)
    layers: dict[int, Layer] = {}
    for layer, scoring in scorings.items():
        oracle = layers.setdefault(layer, Layer())
        experts = run.seen.experts[layer]  # routed experts; the router may rank more classes
        for d in run.seen.decisions[layer]:  # every forward of the layer in the step
            counts = np.bincount(d.chosen[d.chosen < experts], minlength=experts)
            if scoring is None:  # not judged: its microbatch balance only
                oracle.add_counts(counts)
                continue
            chosen = np.zeros((len(d.chosen), scoring.num_experts), dtype=bool)
            np.put_along_axis(chosen, d.chosen, True, axis=1)
            oracle.add(_oracle_router(scoring), d.logits, chosen, d.bias, counts=counts)
    expected = expected_keys({layer: v.values() for layer, v in layers.items()})
    assert_matches(run.metrics, expected, tokens=BATCH * SEQ)
    if mn.EXPERT_BIAS_TOPK_OVERLAP in expected:  # the random biases moved some choices
        assert run.metrics[mn.EXPERT_BIAS_TOPK_OVERLAP] < 1, model_type


@pytest.mark.parametrize("model_type", FAMILIES)
def test_routers_not_judged_warn_with_their_reason_and_log_no_router_keys(model_type):
    run, scorings = family_run(model_type), _scorings(model_type)
    skipped = [layer for layer, s in scorings.items() if s is None]
    if model_type not in NOT_JUDGED:
        assert not skipped and not run.health_warnings, (model_type, run.health_warnings)
        return
    assert skipped, model_type
    (warning,) = run.health_warnings
    assert NOT_JUDGED[model_type] in warning and f"{len(skipped)} router(s)" in warning
    for layer in skipped:
        keys = [k for k in run.metrics if k.startswith(f"moe/layer_{layer}/router_")]
        assert not keys, (model_type, keys)
        assert f"moe/layer_{layer}/max_over_ideal_microbatch" in run.metrics
    if len(skipped) == len(scorings):
        assert not [k for k in run.metrics if k.startswith("moe/router_")], model_type


def test_a_fill_of_0_outside_the_kept_groups_is_followed_when_biased_scores_fall_below_it():
    """A.X-K2 masks the experts of the groups it does not keep with 0, not -inf: an expert
    whose biased score is negative ranks below them, and the scoring says so."""
    import copy
    import dataclasses

    run, scorings = family_run("axk2"), _scorings("axk2")
    layer, scoring = next((k, s) for k, s in scorings.items() if s is not None)
    assert scoring.grouped and scoring.group_masked_score == 0.0
    router = copy.deepcopy(run.model.get_submodule(f"model.layers.{layer}.mlp.gate"))
    size = scoring.num_experts // scoring.num_groups
    with torch.no_grad():
        router.e_score_correction_bias[:] = -2.0  # one expert per group scores above 0
        router.e_score_correction_bias[::size] = 0.0
        hidden = torch.randn(64, router.hidden_dim, generator=torch.Generator().manual_seed(0))
        z, _, index = router(hidden)
    bias = router.e_score_correction_bias
    ours = chosen_experts(z, scoring, bias).sort(1).values
    assert torch.equal(ours, index.sort(1).values)
    strict = dataclasses.replace(scoring, group_masked_score=float("-inf"))
    assert not torch.equal(chosen_experts(z, strict, bias).sort(1).values, ours)
