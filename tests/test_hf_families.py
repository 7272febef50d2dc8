"""Every MoE family the installed transformers ships: expert counts, aux losses and config facts.

The families come from ``hf_families.moe_families()`` (transformers' own mappings, no hand list).
Each family's tiny model trains one step under ``PolicyMetrics`` (every MoE flag on) while
independent hooks record what the model did:

- counts: a numpy ``bincount`` of the indices the experts module is called with (a forward
  pre-hook on each experts module), cross-checked against the router's own output where the
  router returns ``(logits, weights, indices)``; the named adapters are checked against what
  their model exposes (llama4's router scores, jetmoe's own ``expert_size``, doge's expert
  lookup, longcat_flash's and zaya's picks of zero-computation experts);
- aux losses: the family's own ``load_balancing_loss_func`` applied to each layer of the
  ``router_logits`` transformers itself returns with ``output_router_logits=True``;
- config facts: the experts and top-k the config reader finds equal the built model's.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_families import (  # noqa: E402
    VOCAB,
    is_experts_class,
    moe_families,
    shared_tiny_model,
    tiny_model,
)

from nemo_moe_metrics import metric_names as mn  # noqa: E402
from nemo_moe_metrics.config import MetricsConfig  # noqa: E402
from nemo_moe_metrics.moe.hf_models import config_num_experts, config_topk  # noqa: E402
from nemo_moe_metrics.worker import PolicyMetrics, model_facts  # noqa: E402

BATCH, SEQ = 2, 12
FAMILIES = [f.model_type for f in moe_families()]


@dataclass
class Observed:
    """What the independent hooks saw in one training step, per global layer id."""

    counts: dict[int, np.ndarray] = field(default_factory=dict)
    router_counts: dict[int, np.ndarray] = field(default_factory=dict)
    zero_picks: dict[int, int] = field(default_factory=dict)
    topk: dict[int, int] = field(default_factory=dict)
    experts: dict[int, int] = field(default_factory=dict)


def _layer(name: str) -> int | None:
    for part in ("layers.", "blocks."):
        if part in name:
            return int(name.split(part)[1].split(".")[0])
    return None


def _add(store: dict[int, Any], layer: int, value: Any) -> None:
    store[layer] = store.get(layer, 0) + value


def _independent_hooks(model: Any, seen: Observed) -> list[Any]:
    """Hooks that record the executed routing without the library's code."""
    handles = []
    modules = dict(model.named_modules())

    def hook(module, fn, *, pre=False):
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        handles.append(register(fn, with_kwargs=True))

    for name, module in modules.items():
        layer, kind = _layer(name), type(module).__name__
        if layer is None:
            continue
        if kind == "LongcatFlashTopkRouter":  # raw ids, zero-computation experts included

            def longcat(m, a, k, out, layer=layer, e=model.config.n_routed_experts):
                ids = out[2].reshape(-1).numpy()
                _add(seen.router_counts, layer, np.bincount(ids[ids < e], minlength=e))
                _add(seen.zero_picks, layer, int((ids >= e).sum()))

            hook(module, longcat)
        elif kind == "ZayaRouter":  # the router's choice recomputed: class num_experts = skip

            def zaya(m, a, k, out, layer=layer):
                probs = torch.softmax(out[0].detach().float(), -1) + m.balancing_biases
                ids = probs.topk(m.top_k, -1).indices.reshape(-1).numpy()
                e = m.num_experts
                _add(seen.router_counts, layer, np.bincount(ids[ids < e], minlength=e))
                _add(seen.zero_picks, layer, int((ids == e).sum()))

            hook(module, zaya)
        elif kind == "Llama4Router":  # unchosen experts score sigmoid(-inf) = 0

            def llama4(m, a, k, out, layer=layer):
                _add(seen.counts, layer, (out[0] > 0).numpy().sum(0))
                seen.topk[layer], seen.experts[layer] = m.top_k, m.num_experts

            hook(module, llama4)
        elif kind == "JetMoeTopKGating" and ".mlp." in name:  # jetmoe's own expert_size

            def jetmoe(m, a, k, out, layer=layer):
                _add(seen.counts, layer, np.asarray(out[3]))
                seen.topk[layer], seen.experts[layer] = m.top_k, m.num_experts

            hook(module, jetmoe)
        elif kind == "DogeCDMoE":  # the expert ids it looks up in down_embed

            def doge(m, a, k, layer=layer, block=module):
                ids = a[0].reshape(-1).numpy()
                _add(seen.counts, layer, np.bincount(ids, minlength=block.num_experts))
                seen.topk[layer], seen.experts[layer] = block.top_k, block.num_experts

            hook(module.down_embed, doge, pre=True)
        elif is_experts_class(type(module)) and not any(
            is_experts_class(type(modules[p])) for p in modules if name.startswith(p + ".")
        ):  # the outermost experts module: the indices it is called with

            def experts(m, a, k, layer=layer):
                index = a[1] if len(a) > 1 else k["top_k_index"]
                size = int(getattr(m, "num_experts", 0) or m.mlp.num_experts)
                _add(seen.counts, layer, np.bincount(index.reshape(-1).numpy(), minlength=size))
                seen.topk[layer], seen.experts[layer] = int(index.shape[-1]), size

            hook(module, experts, pre=True)
    # Routers returning (logits, weights, indices): their indices, for the cross-check.
    for name, module in modules.items():
        layer, kind = _layer(name), type(module).__name__
        if layer is None or kind in ("LongcatFlashTopkRouter", "ZayaRouter"):
            continue
        if "Router" in kind or name.endswith((".gate", ".router")):

            def router(m, a, k, out, layer=layer):
                ids = out[2] if isinstance(out, tuple) and len(out) >= 3 else None
                if torch.is_tensor(ids) and ids.dtype == torch.int64 and ids.dim() == 2:
                    size = out[0].shape[-1]  # the logits: one column per expert
                    _add(
                        seen.router_counts,
                        layer,
                        np.bincount(ids.reshape(-1).numpy(), minlength=size),
                    )

            hook(module, router)
    return handles


@dataclass
class FamilyRun:
    model_type: str
    model: Any
    metrics: dict[str, Any]
    seen: Observed
    router_logits: tuple | None
    reference_loss: Any


_RUNS: dict[str, FamilyRun] = {}


def _run(model_type: str) -> FamilyRun:
    if model_type in _RUNS:
        return _RUNS[model_type]
    if model_type == "zaya":  # its skip class starts with bias -1: make it chosen, and counted
        model = tiny_model(model_type)
        for module in model.modules():
            if type(module).__name__ == "ZayaRouter":
                module.balancing_biases[-1] = 0.0
    else:
        model = shared_tiny_model(model_type)
    cfg = MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True)
    metrics = PolicyMetrics(cfg)
    metrics.attach(model, model.config)
    seen = Observed()
    handles = _independent_hooks(model, seen)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with metrics.step():
        metrics.microbatch(seq_lens=[SEQ] * BATCH)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
    for h in handles:
        h.remove()
    step = metrics.finish_step(num_microbatches=1)
    metrics.detach()  # the model is shared with the other family matrices
    model.zero_grad(set_to_none=True)
    module = sys.modules[type(model).__module__]
    _RUNS[model_type] = FamilyRun(
        model_type,
        model,
        step,
        seen,
        getattr(out, "router_logits", None),
        getattr(module, "load_balancing_loss_func", None),
    )
    return _RUNS[model_type]


def _table(metrics: dict[str, Any]) -> dict[int, np.ndarray]:
    rows = metrics[mn.EXPERT_LOADS]
    out: dict[int, list] = {}
    for layer, expert, tokens, _ in rows:
        out.setdefault(layer, []).append((expert, tokens))
    return {layer: np.array([t for _, t in sorted(v)]) for layer, v in out.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_counts_equal_what_the_experts_executed(model_type):
    run = _run(model_type)
    seen = run.seen
    expected = seen.router_counts if seen.zero_picks else seen.counts
    assert expected, f"{model_type}: the independent hooks saw no MoE layer"
    table = _table(run.metrics)
    assert sorted(table) == sorted(expected), (
        f"{model_type}: MoE layers {sorted(table)} != {sorted(expected)}"
    )
    for layer, counts in expected.items():
        np.testing.assert_array_equal(table[layer], counts, err_msg=f"{model_type} layer {layer}")
        # a router returning (logits, weights, indices) chose exactly what the experts executed
        if layer in seen.router_counts and not seen.zero_picks:
            np.testing.assert_array_equal(seen.router_counts[layer], counts)
    # Each layer routes every token once per pass (inkling2_loop runs its looped layers three
    # times): its picks over its top-k, zero-computation picks included.
    picks = {
        layer: int(counts.sum()) + seen.zero_picks.get(layer, 0)
        for layer, counts in expected.items()
    }
    routed = {layer: n / seen.topk[layer] for layer, n in picks.items()}
    assert all(n % (BATCH * SEQ) == 0 for n in routed.values()), routed
    assert run.metrics[mn.ROUTED_TOKENS] == max(routed.values())
    if seen.zero_picks:
        assert run.metrics[mn.ZERO_EXPERT_FRACTION] == pytest.approx(
            sum(seen.zero_picks.values()) / sum(picks.values())
        )
        assert run.metrics[mn.DROPPED_FRACTION] == pytest.approx(0.0, abs=1e-12)
    else:
        assert mn.ZERO_EXPERT_FRACTION not in run.metrics


@pytest.mark.parametrize("model_type", FAMILIES)
def test_aux_loss_equals_transformers_function_per_layer(model_type):
    run = _run(model_type)
    logits, function = run.router_logits, run.reference_loss
    ours = {
        int(k.rsplit("_", 1)[1]): v
        for k, v in run.metrics.items()
        if k.startswith("moe/load_balancing_loss_layer_")
    }
    if function is None or not logits:
        assert not ours and mn.aux_loss_key("load_balancing_loss") not in run.metrics, (
            f"{model_type} trains without a load-balancing loss, yet one was reported"
        )
        return
    model = run.model
    if model_type == "jetmoe":  # its recorder also returns the attention-head routers' logits
        logits = logits[1::2]
    assert sorted(ours) and len(ours) == len(logits), (model_type, sorted(ours), len(logits))
    for layer, layer_logits in zip(sorted(ours), logits, strict=True):
        if model_type == "doge":
            want = function(
                (layer_logits,),
                model.num_experts,
                math.floor(math.sqrt(model.num_experts)),
                model.num_experts_per_tok,
            )
        else:
            want = function((layer_logits,), model.num_experts, model.num_experts_per_tok)
        want = float(torch.as_tensor(want).detach())
        assert ours[layer] == pytest.approx(want, rel=1e-5), f"{model_type} layer {layer}"
    mean = float(np.mean(list(ours.values())))
    assert run.metrics[mn.aux_loss_key("load_balancing_loss")] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_facts_match_the_built_model(model_type):
    run = _run(model_type)
    text = run.model.config.get_text_config()
    facts = model_facts(run.model.config)
    experts = set(run.seen.experts.values())
    assert facts.num_experts in experts, (model_type, facts.num_experts, experts)
    assert config_num_experts(text) == facts.num_experts
    assert config_topk(text) in set(run.seen.topk.values()), (
        model_type,
        config_topk(text),
        run.seen.topk,
    )


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_models_page_holds_the_generated_table(lang):
    from pathlib import Path

    from hf_families import support_table

    page = Path(__file__).resolve().parent.parent / "docs" / lang / "models.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(support_table()[0])
    assert lines[start : start + 2 + len(FAMILIES)] == support_table(), (
        f"docs/{lang}/models.md: regenerate its table with `python tests/hf_families.py --table`"
    )
