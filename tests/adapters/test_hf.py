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

The same runs (router health on, every expert bias set to small random values so that it moves
some choices, zero-initialised router weights made random) also record each router's own decision
for ``adapters/test_hf_health.py``: its logits, the classes it chose, their weights and the bias it
ranked with (:class:`Decision`).
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
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

from nemo_moe_metrics.config import MetricsConfig  # noqa: E402
from nemo_moe_metrics.export import metric_names as mn  # noqa: E402
from nemo_moe_metrics.flops.hf_fields import config_num_experts, config_topk  # noqa: E402
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics, model_facts  # noqa: E402

BATCH, SEQ = 2, 12
FAMILIES = [f.model_type for f in moe_families()]


@dataclass
class Decision:
    """One router forward as the router itself produced it (numpy, one row per token)."""

    logits: np.ndarray  # z [T, classes]: the router's logits, before its score function
    chosen: np.ndarray  # [T, k] the classes it chose (zero-computation ones included)
    weights: np.ndarray | None  # [T, k] their routing weights, where the router returns them
    bias: np.ndarray | None  # the expert bias it ranked with


@dataclass
class Observed:
    """What the independent hooks saw in one training step, per global layer id."""

    counts: dict[int, np.ndarray] = field(default_factory=dict)
    router_counts: dict[int, np.ndarray] = field(default_factory=dict)
    zero_picks: dict[int, int] = field(default_factory=dict)
    topk: dict[int, int] = field(default_factory=dict)
    experts: dict[int, int] = field(default_factory=dict)
    decisions: dict[int, list[Decision]] = field(default_factory=dict)


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


#: where transformers routers keep the expert bias they add to their selection scores
BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")


def _numpy(t: Any) -> np.ndarray | None:
    return None if t is None else t.detach().float().reshape(t.shape[0], -1).numpy()


def _bias_of_call(router: Any, args: tuple, kwargs: dict) -> np.ndarray | None:
    """The bias the router was called with (a ``...bias...`` argument) or holds itself."""
    params = list(inspect.signature(type(router).forward).parameters)[1:]
    for i, name in enumerate(params):
        if "bias" in name:
            bias = args[i] if len(args) > i else kwargs.get(name)
            return None if bias is None else bias.detach().float().reshape(-1).numpy().copy()
    for name, t in [*router.named_buffers(), *router.named_parameters()]:
        if name.rpartition(".")[2] in BIAS_NAMES:
            return t.detach().float().reshape(-1).numpy().copy()
    return None


def _decision_hooks(model: Any, seen: Observed) -> list[Any]:
    """Record each router's own decision (its output, not a top-k recomputed from logits)."""
    handles = []
    pending: dict[int, Any] = {}  # z waiting for the rest of its layer's decision

    def add(layer: int, z: Any, chosen: Any, weights: Any, bias: np.ndarray | None) -> None:
        z = z.detach().float().reshape(-1, z.shape[-1]).numpy()
        decision = Decision(z, np.asarray(chosen).reshape(len(z), -1), weights, bias)
        seen.decisions.setdefault(layer, []).append(decision)

    for name, module in model.named_modules():
        layer, kind = _layer(name), type(module).__name__
        if layer is None:
            continue
        if kind == "Gemma4TextRouter":  # returns softmax(z) first; z is its proj's output

            def gemma4_z(m, a, out, layer=layer):
                pending[layer] = out

            def gemma4(m, a, k, out, layer=layer):
                add(layer, pending.pop(layer), out[2].numpy(), _numpy(out[1]), None)

            handles.append(module.proj.register_forward_hook(gemma4_z))
            handles.append(module.register_forward_hook(gemma4, with_kwargs=True))
        elif kind == "ZayaRouter":  # a pick of the skip class arrives as expert 0, weight 0

            def zaya(m, a, k, out, layer=layer):
                ids = torch.where(out[1] == 0, m.num_experts, out[2])
                add(layer, out[0], ids.numpy(), _numpy(out[1]), _bias_of_call(m, a, k))

            handles.append(module.register_forward_hook(zaya, with_kwargs=True))
        elif kind == "Llama4Router":  # (scores, logits); unchosen experts score sigmoid(-inf)

            def llama4(m, a, k, out, layer=layer):
                ids = out[0].topk(m.top_k, dim=-1).indices  # the k scores above 0
                add(layer, out[1], ids.numpy(), _numpy(out[0].gather(1, ids)), None)

            handles.append(module.register_forward_hook(llama4, with_kwargs=True))
        elif kind == "JetMoeTopKGating" and ".mlp." in name:  # expert-sorted assignments

            def jetmoe(m, a, k, out, layer=layer):
                sorted_experts = np.repeat(np.arange(m.num_experts), out[3])
                tokens, gates = out[1].numpy(), out[2].detach().float().numpy()
                order = np.argsort(tokens, kind="stable")
                ids = sorted_experts[order].reshape(-1, m.top_k)
                add(layer, out[4], ids, gates[order].reshape(-1, m.top_k), None)

            handles.append(module.register_forward_hook(jetmoe, with_kwargs=True))
        elif kind == "DbrxRouter":  # returns z; its FFN chooses and calls the experts

            def dbrx_z(m, a, out, layer=layer):
                pending[layer] = out

            def dbrx(m, a, k, layer=layer):
                add(layer, pending.pop(layer), a[1].numpy(), _numpy(a[2]), None)

            handles.append(module.register_forward_hook(dbrx_z))
            block = model.get_submodule(name.rpartition(".")[0])
            handles.append(block.experts.register_forward_pre_hook(dbrx, with_kwargs=True))
        elif kind == "DogeCDMoE":  # product keys: expert i * n + j scores x_i + y_j

            def doge_z(m, a, out, layer=layer, keys=module.num_keys):
                x, y = out.detach().reshape(2, -1, keys)  # split as DogeCDMoE.forward splits it
                pending[layer] = (x[:, :, None] + y[:, None, :]).reshape(x.shape[0], -1)

            def doge(m, a, k, layer=layer):
                add(layer, pending.pop(layer), a[0].reshape(-1, a[0].shape[-1]).numpy(), None, None)

            handles.append(module.router_gate.register_forward_hook(doge_z))
            handles.append(module.down_embed.register_forward_pre_hook(doge, with_kwargs=True))
        elif (
            "Router" in kind or name.endswith((".gate", ".router"))
        ) and kind != "JetMoeTopKGating":

            def router(m, a, k, out, layer=layer):
                ids = out[2] if isinstance(out, tuple) and len(out) >= 3 else None
                if torch.is_tensor(ids) and ids.dtype == torch.int64 and ids.dim() == 2:
                    add(layer, out[0], ids.numpy(), _numpy(out[1]), _bias_of_call(m, a, k))

            handles.append(module.register_forward_hook(router, with_kwargs=True))
    return handles


def _randomise_routing(model: Any) -> Any:
    """Small random expert biases (zero at init), so that they move some routing choices, and
    random router weights where they start at zero (afmoe: every expert ties on every token).
    Returns the function that puts the model's own values back."""
    g = torch.Generator().manual_seed(2)
    changed: list[tuple[Any, Any]] = []  # (tensor, its own values)
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.rpartition(".")[2] in BIAS_NAMES:
                changed.append((t, t.clone()))
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
        for module in model.modules():
            if "Router" in type(module).__name__:
                for name, w in module.named_parameters():
                    if name.endswith("weight") and w.dim() == 2 and not w.any():
                        changed.append((w, w.clone()))
                        w.copy_(0.02 * torch.randn(w.shape, generator=g))

    def restore() -> None:
        with torch.no_grad():
            for t, own in changed:
                t.copy_(own)

    return restore


@dataclass
class FamilyRun:
    model_type: str
    model: Any
    metrics: dict[str, Any]
    seen: Observed
    router_logits: tuple | None
    reference_loss: Any
    health_warnings: list[str]


_RUNS: dict[str, FamilyRun] = {}


def family_run(model_type: str) -> FamilyRun:
    if model_type in _RUNS:
        return _RUNS[model_type]
    if model_type == "zaya":  # its skip class starts with bias -1: make it chosen, and counted
        model = tiny_model(model_type)
        for module in model.modules():
            if type(module).__name__ == "ZayaRouter":
                module.balancing_biases[-1] = 0.0
    else:
        model = shared_tiny_model(model_type)
    restore_routing = _randomise_routing(model)
    cfg = MetricsConfig(
        track_moe_metrics=True, moe_per_layer_logging=True, track_router_health=True
    )
    metrics = PolicyMetrics(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics.attach(model, model.config)
    health_warnings = [str(w.message) for w in caught if "track_router_health" in str(w.message)]
    seen = Observed()
    handles = _independent_hooks(model, seen) + _decision_hooks(model, seen)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with metrics.step():
        metrics.microbatch(seq_lens=[SEQ] * BATCH)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
    for h in handles:
        h.remove()
    step = metrics.finish_step(num_microbatches=1)
    metrics.detach()  # the model is shared with the other family matrices
    restore_routing()  # the decisions are recorded; the model is as built again
    model.zero_grad(set_to_none=True)
    module = sys.modules[type(model).__module__]
    _RUNS[model_type] = FamilyRun(
        model_type,
        model,
        step,
        seen,
        getattr(out, "router_logits", None),
        getattr(module, "load_balancing_loss_func", None),
        health_warnings,
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
    run = family_run(model_type)
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
    run = family_run(model_type)
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
    # What the model's own loss passes the function (a vision-language model: its text config).
    own = model if hasattr(model, "num_experts") else model.config.get_text_config()
    experts, topk = own.num_experts, own.num_experts_per_tok
    for layer, layer_logits in zip(sorted(ours), logits, strict=True):
        if model_type == "doge":
            want = function((layer_logits,), experts, math.floor(math.sqrt(experts)), topk)
        else:
            want = function((layer_logits,), experts, topk)
        want = float(torch.as_tensor(want).detach())
        assert ours[layer] == pytest.approx(want, rel=1e-5), f"{model_type} layer {layer}"
    mean = float(np.mean(list(ours.values())))
    assert run.metrics[mn.aux_loss_key("load_balancing_loss")] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_config_facts_match_the_built_model(model_type):
    run = family_run(model_type)
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


def test_modality_isolated_experts_say_which_set_is_counted():
    # ernie4_5_vl_moe: text and vision experts in every MoE layer; the table is the text set.
    if "ernie4_5_vl_moe" not in FAMILIES:
        pytest.skip("this transformers has no ernie4_5_vl_moe")
    model = tiny_model("ernie4_5_vl_moe")
    cfg = MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True)
    metrics = PolicyMetrics(cfg)
    with pytest.warns(UserWarning, match="the vision experts, which only image and video"):
        metrics.attach(model, model.config)
    seen = Observed()  # what each expert set executed, by its own hooks
    handles = _independent_hooks(model, seen)
    vision: dict[int, np.ndarray] = {}
    for name, module in model.named_modules():
        if name.endswith("vision_moe.experts"):
            layer = _layer(name)

            def vision_picks(m, a, layer=layer):
                _add(vision, layer, np.bincount(a[1].reshape(-1).numpy(), minlength=m.num_experts))

            handles.append(module.register_forward_pre_hook(vision_picks))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kinds = torch.zeros(BATCH, SEQ, dtype=torch.long)
    kinds[:, 3:7] = 1  # image tokens, as the processor marks them
    with metrics.step():
        metrics.microbatch(seq_lens=torch.full((BATCH,), SEQ))
        model(input_ids=ids, labels=ids, moe_mm_token_type_ids=kinds).loss.backward()
    for h in handles:
        h.remove()
    step = metrics.finish_step(num_microbatches=1)
    text_tokens = int((kinds == 0).sum())
    topk = model.config.get_text_config().num_experts_per_tok
    assert step[mn.ROUTED_TOKENS] == text_tokens
    # Every token ran the model (the throughput counts them all), though the text experts saw
    # fewer: that is the design, not a seq_lens mistake (finish_step refuses that elsewhere).
    assert step[mn.TOKENS] == BATCH * SEQ
    table = _table(step)
    assert vision and sorted(table) == sorted(vision)
    for layer, counts in table.items():
        assert vision[layer].sum() == (BATCH * SEQ - text_tokens) * topk  # image tokens ran
        # the hooks saw both sets' picks; the table is the text set's alone
        np.testing.assert_array_equal(counts, seen.counts[layer] - vision[layer])
        assert counts.sum() == text_tokens * topk


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_models_page_holds_the_generated_table(lang):
    from pathlib import Path

    from hf_families import support_table

    page = Path(__file__).resolve().parents[2] / "docs" / lang / "models.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(support_table()[0])
    assert lines[start : start + 2 + len(FAMILIES)] == support_table(), (
        f"docs/{lang}/models.md: regenerate its table with "
        "`python tests/support/hf_families.py --table`"
    )


def test_a_model_with_two_moe_stacks_is_refused_naming_both():
    # diffusion_gemma: an encoder and a decoder, each with MoE layers numbered from 0.
    import transformers
    from hf_families import tiny_kwargs
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if "diffusion_gemma" not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        pytest.skip("this transformers has no diffusion_gemma")
    config_class = CONFIG_MAPPING["diffusion_gemma"]
    model_class = getattr(
        transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES["diffusion_gemma"]
    )
    with torch.device("meta"):
        model = model_class(config_class(**tiny_kwargs(config_class)))
    with pytest.raises(ValueError, match="two MoE stacks") as refused:
        PolicyMetrics(MetricsConfig(track_moe_metrics=True)).attach(model, model.config)
    assert "'model.encoder.language_model'" in str(refused.value)
    assert "'model.decoder'" in str(refused.value)


def test_a_vision_language_model_trained_on_an_image_counts_its_image_tokens():
    # The matrix trains on text; here qwen3_vl_moe sees an image as a VLM trainer feeds it:
    # pixel values through its vision tower, merged patches in place of the image tokens.
    if "qwen3_vl_moe" not in FAMILIES:
        pytest.skip("this transformers has no qwen3_vl_moe")
    special = dict(
        image_token_id=5, video_token_id=6, vision_start_token_id=7, vision_end_token_id=8
    )
    model = tiny_model("qwen3_vl_moe", **special)
    vision = model.config.vision_config
    grid = torch.tensor([[1, 4, 4]])  # one image of 4 x 4 patches
    patch_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(grid.prod()), patch_width, generator=torch.Generator().manual_seed(3))
    image_tokens = int(grid.prod()) // vision.spatial_merge_size**2
    ids = torch.randint(10, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    ids[0, 2], ids[0, 3 : 3 + image_tokens], ids[0, 3 + image_tokens] = 7, 5, 8
    cfg = MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, track_throughput=True)
    metrics = PolicyMetrics(cfg)
    metrics.attach(model, model.config)
    seen = Observed()
    handles = _independent_hooks(model, seen)
    with metrics.step():
        metrics.microbatch(seq_lens=torch.tensor([SEQ]))
        out = model(
            input_ids=ids,
            labels=ids,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(ids == 5).long(),
        )
        out.loss.backward()
    for h in handles:
        h.remove()
    step = metrics.finish_step(num_microbatches=1)
    assert step[mn.ROUTED_TOKENS] == step[mn.TOKENS] == SEQ  # the image's tokens routed too
    table = _table(step)
    assert table and sorted(table) == sorted(seen.counts)
    for layer, counts in seen.counts.items():
        np.testing.assert_array_equal(table[layer], counts)
        assert counts.sum() == SEQ * seen.topk[layer]
