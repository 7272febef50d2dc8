"""The megatron-core adapter: the same behaviour on 0.16 and 0.19, no deprecated megatron call.

CI runs this file on both supported lines (Python 3.11 + 0.16.x, Python 3.12 + newest 0.19.x).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import ok_values, run_ranks

import nemo_moe_metrics

pytestmark = pytest.mark.megatron

PACKAGE_DIR = str(Path(nemo_moe_metrics.__file__).resolve().parent)


def _train_one_microbatch(model, vocab: int, seq: int = 16) -> None:
    from nemo_moe_metrics.megatron.model import causal_attention_mask

    tokens = torch.randint(0, vocab, (2, seq))
    pos = torch.arange(seq).expand(2, seq)
    model(tokens, pos, causal_attention_mask(seq), labels=tokens).mean().backward()


def _lifecycle(rank, world_size):
    """Build, train, export and reset through the package, recording every warning."""
    import warnings

    from nemo_moe_metrics.config import MegatronConfig, ModelConfig
    from nemo_moe_metrics.megatron import compat
    from nemo_moe_metrics.megatron.model import (
        build_model,
        build_transformer_config,
        init_distributed,
    )
    from nemo_moe_metrics.moe.aux_loss import aux_loss_metrics

    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcfg = MegatronConfig()
        init_distributed(mcfg)
        for name, cfg in (
            ("gpt4", ModelConfig(num_layers=4, moe_z_loss_coeff=1e-3, seq_length=16)),
            ("hybrid6", ModelConfig(num_layers=6, hybrid_layer_pattern="*E-E*E", seq_length=16)),
            ("gpt2", ModelConfig(num_layers=2, seq_length=16)),
        ):
            # A model with another layer count: megatron would reuse the old vectors.
            compat.reset_tracker()
            model = build_model(cfg, mcfg)
            _train_one_microbatch(model, cfg.vocab_size)
            lengths = {k: v.numel() for k, v in compat.tracker_values().items()}
            metrics = aux_loss_metrics(
                build_transformer_config(cfg, mcfg), num_microbatches=1, per_layer=False
            )
            cleared = all(not v.any() for v in compat.tracker_values().values())
            out[name] = dict(lengths=lengths, metrics=metrics, cleared=cleared)
    out["ours"] = [
        f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, DeprecationWarning) and w.filename.startswith(PACKAGE_DIR)
    ]
    return out


@pytest.fixture(scope="module")
def lifecycle():
    (result,) = ok_values(run_ranks(_lifecycle, 1, timeout=240))
    return result


@pytest.mark.timeout(300)
def test_no_deprecation_warning_is_attributed_to_this_package(lifecycle):
    # megatron-core 0.19 deprecates the tracker functions 0.16 offers (DeprecationWarning with
    # stacklevel 2, i.e. attributed to the caller): the adapter must not call them there.
    assert lifecycle["ours"] == []


@pytest.mark.timeout(300)
def test_tracker_vectors_take_each_new_models_length_after_reset(lifecycle):
    assert lifecycle["gpt4"]["lengths"] == {"load_balancing_loss": 4, "z_loss": 4}
    assert lifecycle["hybrid6"]["lengths"] == {"load_balancing_loss": 6}
    assert lifecycle["gpt2"]["lengths"] == {"load_balancing_loss": 2}


@pytest.mark.timeout(300)
def test_export_clears_the_tracker_and_reports_positive_losses(lifecycle):
    for name in ("gpt4", "hybrid6", "gpt2"):
        assert lifecycle[name]["cleared"], name
        assert lifecycle[name]["metrics"]["moe/load_balancing_loss"] > 0, name


def test_tracker_entries_can_be_installed_read_and_dropped_in_process():
    from nemo_moe_metrics.megatron import compat

    compat.put_tracker_entry("probe_loss", torch.arange(3.0))
    try:
        assert compat.tracker_values()["probe_loss"].tolist() == [0.0, 1.0, 2.0]
        compat.clear_tracker()
        assert compat.tracker_values()["probe_loss"].tolist() == [0.0, 0.0, 0.0]
    finally:
        compat.drop_tracker_entry("probe_loss")
    assert "probe_loss" not in compat.tracker_values()
