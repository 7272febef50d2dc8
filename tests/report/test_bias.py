"""The report's aux-loss-free part: bias next to load for the worst layers (synthetic run)."""

import json

import pytest

pytest.importorskip("matplotlib")


def _write_run(run_dir, with_bias=True):
    rows = []
    for step in range(4):
        row = {"step": step, "moe/max_over_ideal": 1.2}
        for layer, load in ((0, 1.1), (1, 1.9), (2, 1.3), (3, 1.05), (4, 1.6), (5, 1.0)):
            row[f"moe/layer_{layer}/max_over_ideal"] = load + 0.01 * step
            if with_bias:
                row[f"moe/layer_{layer}/expert_bias_range"] = 0.001 * (step + 1) * (layer + 1)
        if with_bias:
            row["moe/expert_bias_range"] = 0.0035 * (step + 1)
            row["moe/expert_bias_update"] = 0.001
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_draws_bias_next_to_load_of_the_worst_layers(tmp_path):
    from nemo_moe_metrics.report import render_report

    _write_run(tmp_path)
    summary = render_report(tmp_path)
    assert "expert bias (aux-loss-free balancing, last step): range mean 0.014" in summary
    worst = next(line for line in summary.splitlines() if line.startswith("worst layers"))
    # the four worst by mean max/ideal: 1, 4, 2, 0 (ascending ids), last-step values
    assert worst == (
        "worst layers (last step): layer 0 max/ideal 1.13 bias range 0.004; "
        "layer 1 max/ideal 1.93 bias range 0.008; layer 2 max/ideal 1.33 bias range 0.012; "
        "layer 4 max/ideal 1.63 bias range 0.02"
    )
    assert (tmp_path / "expert_bias.png").stat().st_size > 10_000
    assert "aux losses: none logged (the routers balance with the expert bias above)" in summary


def test_report_without_bias_keys_draws_no_bias_picture(tmp_path):
    from nemo_moe_metrics.report import render_report

    _write_run(tmp_path, with_bias=False)
    summary = render_report(tmp_path)
    assert "expert bias" not in summary
    assert not (tmp_path / "expert_bias.png").exists()
