"""Token mixers read from a transformers model's modules (flops/hf_mixers.py): recurrent cores and
convolutions follow the module sizes; causal attention counts the pairs the masks keep."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.flops.test_hf_modules import flops_model

torch = pytest.importorskip("torch")

transformers = pytest.importorskip("transformers")

from flops_counting import KERNEL_FUNCTIONS  # noqa: E402
from hf_families import moe_families  # noqa: E402

from nemo_moe_metrics.flops.hf_modules import (  # noqa: E402
    estimator_from_model,
)

MODEL_TYPES = [f.model_type for f in moe_families()]

pytestmark = pytest.mark.usefixtures("one_thread")

# One training step over two sequences. Odd, unequal lengths: no window, chunk or compression
# rate of the tiny configs divides them, so partial blocks are exercised.
LENGTHS = [17, 26]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- kernels against their modules' sizes ------------------------------------------------


def _runs_kimi_kernel(module: Any) -> bool:
    """A Kimi Delta Attention mixer by what its forward runs, whatever its class name."""
    if not type(module).__module__.startswith("transformers.models."):
        return False
    return "chunk_kimi_delta_attention(" in inspect.getsource(type(module).forward)


def _recurrent_macs(module: Any) -> tuple[str, int] | None:
    """(component, recurrent-equivalent multiply-adds per token) of a linear-attention or
    state-space mixer, from the module's own sizes (docs/en/flops.md)."""
    name = type(module).__name__
    if name.endswith("GatedDeltaNet"):  # S^T k, the delta update, S^T q
        return (
            "linear_attention_core",
            3 * module.num_v_heads * module.head_k_dim * module.head_v_dim,
        )
    if name.endswith("DeltaAttention") or _runs_kimi_kernel(module):  # KDA: the same three
        return "linear_attention_core", 3 * module.num_heads * module.head_dim**2
    if name.endswith("LightningAttention"):  # k v^T into the state, S^T q
        return "linear_attention_core", 2 * module.num_attention_heads * module.head_dim**2
    if hasattr(module, "x_proj") and hasattr(module, "A_log"):  # Mamba-1: x B in, h C out
        return "mamba_core", 2 * module.intermediate_size * module.ssm_state_size
    if hasattr(module, "n_groups") and hasattr(module, "A_log"):  # Mamba-2
        return "mamba_core", 2 * module.num_heads * module.head_dim * module.ssm_state_size
    return None


def _recurrent_families() -> list[str]:
    """Families with a recurrent mixer by class name, or whose modeling module defines a
    recurrent kernel (GLM-5-Next's Kimi Delta Attention is named ...LinearAttention)."""
    names = ("GatedDeltaNet", "DeltaAttention", "LightningAttention", "Mamba", "ShortConv")
    out = []
    for f in moe_families():
        module = importlib.import_module(f.model_class.__module__)
        named = any(
            isinstance(c, type) and c.__name__.endswith(names) for c in vars(module).values()
        )
        if named or any(hasattr(module, kernel) for kernel in KERNEL_FUNCTIONS):
            out.append(f.model_type)
    return out


@pytest.mark.parametrize("model_type", _recurrent_families())
def test_recurrent_cores_and_convs_follow_the_module_sizes(model_type):
    model = flops_model(model_type)
    tokens = sum(LENGTHS)
    core: dict[str, float] = {}
    conv = 0.0
    for module in model.modules():
        found = _recurrent_macs(module)
        if found is not None:
            core[found[0]] = core.get(found[0], 0.0) + 6.0 * found[1] * tokens
        if found is not None or type(module).__name__.endswith("ShortConv"):
            for child in module.modules():
                if isinstance(child, torch.nn.Conv1d):
                    conv += 6.0 * child.weight.numel() * tokens
    estimate = estimator_from_model(model)(LENGTHS).by_component
    assert core or conv, f"{model_type}: no recurrent mixer found"
    for component, value in core.items():
        assert estimate[component] == pytest.approx(value, rel=1e-12), component
    convs = ("linear_attention_conv", "mamba_conv", "short_conv")
    assert sum(estimate.get(c, 0.0) for c in convs) == pytest.approx(conv, rel=1e-12)


# ---- causal: the pairs the masks keep -----------------------------------------------------


@contextlib.contextmanager
def _attended(model: Any) -> Iterator[list[float]]:
    """Multiply-adds of the attention core as the model's masks allow: at every call of the
    eager attention function, query heads x (d_qk + d_v) x the (query, key) pairs its mask
    keeps. Attention over block states (Inkling 2's residuals) is not token attention."""
    modeling = importlib.import_module(type(model).__module__)
    original = modeling.eager_attention_forward
    total = [0.0]

    def counting(module, query, key, value, attention_mask, *args, **kwargs):
        if not type(module).__name__.endswith("Residual"):
            heads, q_len, d_qk = query.shape[1], query.shape[2], query.shape[-1]
            if attention_mask is None:
                kept = q_len * key.shape[2]
            else:
                mask = attention_mask[0, 0, :, : key.shape[2]]
                if mask.dtype == torch.bool:
                    kept = int(mask.sum())
                else:
                    kept = int((mask > torch.finfo(mask.dtype).min / 2).sum())
            total[0] += heads * (d_qk + value.shape[-1]) * kept
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    modeling.eager_attention_forward = counting
    try:
        yield total
    finally:
        modeling.eager_attention_forward = original


def _qsa_tail(config: Any) -> float:
    """Qwen4's QSA keeps whole blocks of indexer_compress_ratio keys plus the query's partial
    last block, so a query sees up to compress_ratio - 1 keys beyond the indexer_budget the
    estimate counts: at most that share of the kept keys."""
    return (config.indexer_compress_ratio - 1) / config.indexer_budget


#: Relative tolerance of the causal check where the estimate's window is an approximation.
MASK_TOLERANCE: dict[str, Callable[[Any], float]] = {"qwen4_exp_text": _qsa_tail}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_causal_attention_core_counts_the_pairs_the_masks_keep(model_type):
    model = flops_model(model_type)
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    with _attended(model) as kept, torch.no_grad():
        for n in LENGTHS:
            model(input_ids=torch.randint(1, vocab, (1, n), generator=generator), use_cache=False)
    estimate = estimator_from_model(model)(LENGTHS, causal=True).by_component
    assert kept[0] > 0
    tolerance = MASK_TOLERANCE.get(model_type, lambda config: 1e-12)(model.config)
    assert estimate["attention_core"] == pytest.approx(6.0 * kept[0], rel=tolerance)
