"""What a step counts: training forwards inside ``step()`` only, and no made-up zeros.

A tiny Hugging Face Mixtral (2 MoE layers, 8 experts, top-2) through the real PolicyMetrics.
Expected values are hand arithmetic (tokens x top-k) and transformers' own load-balancing loss.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hf_tiny import VOCAB, K, tiny_model

from nemo_moe_metrics.config import AlertsConfig, LoggerConfig, MetricsConfig
from nemo_moe_metrics.export import metric_names as mn
from nemo_moe_metrics.sinks.alerts import AlertMonitor
from nemo_moe_metrics.worker.policy_metrics import PolicyMetrics

BATCH, SEQ = 2, 16  # 32 tokens per forward
FLAGS = MetricsConfig(track_moe_metrics=True, moe_per_layer_logging=True, log_expert_table=True)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _tokens_per_layer(metrics: dict) -> dict[int, int]:
    out: dict[int, int] = {}
    for layer, _expert, tokens, _pct in metrics[mn.EXPERT_LOADS]:
        out[layer] = out.get(layer, 0) + tokens
    return out


def _transformers_layer_losses(logits) -> list[float]:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return [
        float(load_balancing_loss_func((lg.detach(),), num_experts=8, top_k=K)) for lg in logits
    ]


def test_a_training_forward_outside_step_is_not_counted():
    model = tiny_model("mixtral")
    metrics = PolicyMetrics(FLAGS)
    metrics.attach(model, model.config)
    outside = model(input_ids=_ids(1), labels=_ids(1))  # e.g. a probe before the step
    outside.loss.backward()
    with metrics.step():
        ids = _ids(2)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        expected = _transformers_layer_losses(out.router_logits)
    model(input_ids=_ids(3), labels=_ids(3)).loss.backward()  # after the step, before export
    got = metrics.finish_step(num_microbatches=1)
    assert _tokens_per_layer(got) == {0: BATCH * SEQ * K, 1: BATCH * SEQ * K}  # 64, not 128+
    assert got[mn.ROUTED_TOKENS] == BATCH * SEQ
    for layer in (0, 1):
        key = mn.aux_loss_layer_key("load_balancing_loss", layer)
        assert got[key] == pytest.approx(expected[layer], rel=1e-5)


class _Records(logging.Handler):
    """The records one logger emits, read where it emits them (not through the root logger,
    whose handlers other libraries in the same process may replace)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_step_in_which_no_expert_got_a_training_token_logs_only_routed_tokens():
    model = tiny_model("mixtral")
    metrics = PolicyMetrics(FLAGS)
    metrics.attach(model, model.config)
    empty = []
    logger, seen = logging.getLogger("nemo_moe_metrics.worker.policy_metrics"), _Records()
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(seen)
    try:
        for _ in range(2):
            with metrics.step(), torch.no_grad():
                model(input_ids=_ids(4))  # e.g. reference log-probs only
            empty.append(metrics.finish_step(num_microbatches=1))
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    assert empty == [{mn.ROUTED_TOKENS: 0.0}] * 2  # no dead_experts 0, no aux loss 0
    said = [r.getMessage() for r in seen.records if "no expert received" in r.getMessage()]
    assert len(said) == 1 and mn.ROUTED_TOKENS in said[0]
    with metrics.step():
        model(input_ids=_ids(5), labels=_ids(5)).loss.backward()
    real = metrics.finish_step(num_microbatches=1)
    assert real[mn.ROUTED_TOKENS] == BATCH * SEQ
    assert mn.DEAD_EXPERTS in real and mn.aux_loss_key("load_balancing_loss") in real


def _table(hot_share: int) -> list[list]:
    counts = np.full((1, 8), 10)
    counts[0, 0] = hot_share
    return [[0, e, int(c), 100.0 * c / counts.sum()] for e, c in enumerate(counts[0])]


def test_alerts_skip_a_step_without_training_tokens_and_keep_their_state():
    monitor = AlertMonitor(AlertsConfig(enabled=True, max_over_ideal=2.0))
    hot = {mn.EXPERT_LOADS: _table(100), mn.ROUTED_TOKENS: 85.0}
    assert monitor.observe(hot, 0) == {mn.ALERTS: 1}
    assert monitor.observe({mn.ROUTED_TOKENS: 0.0}, 1) == {mn.ALERTS: 0}
    # Still the same overload: it was never judged to stop, so it does not fire again.
    assert monitor.observe(hot, 2) == {mn.ALERTS: 0}


def test_report_says_no_expert_received_a_training_token(tmp_path):
    pytest.importorskip("matplotlib")
    from nemo_moe_metrics.report import render_report
    from nemo_moe_metrics.sinks import build_sinks

    sink = build_sinks(
        LoggerConfig(tensorboard_enabled=False, wandb_enabled=False), tmp_path, run_name="empty"
    )
    for step in range(3):
        sink.log({mn.ROUTED_TOKENS: 0.0}, step)
    sink.close()
    summary = render_report(tmp_path)
    assert "no expert received a training token" in summary
    assert "dead experts" not in summary and "track_moe_metrics=true" not in summary
