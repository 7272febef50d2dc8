"""The report's router-health part: picture, summary line and the worst layers (synthetic run)."""

import json

import pytest

pytest.importorskip("matplotlib")

pytestmark = pytest.mark.one_line

NEAR_TIES = {1: 0.10, 2: 0.40, 3: 0.25, 5: 0.05, 6: 0.30, 7: 0.12}


def _write_run(run_dir, *, per_layer=True, health=True):
    rows = []
    for step in range(5):
        row = {"step": step, "moe/max_over_ideal": 1.3 + 0.01 * step}
        if health:
            row.update(
                {
                    "moe/router_confidence": 0.31 + 0.01 * step,
                    "moe/router_confidence_min": 0.29,
                    "moe/router_near_tie_fraction": 0.2,
                    "moe/router_near_tie_fraction_max": 0.4 + 0.01 * step,
                    "moe/router_logit_max_abs": 2.5,
                    "moe/max_over_ideal_microbatch": 1.8,
                }
            )
        if health and per_layer:
            for layer, ties in NEAR_TIES.items():
                row[f"moe/layer_{layer}/router_near_tie_fraction"] = ties + 0.001 * step
                row[f"moe/layer_{layer}/router_confidence"] = 0.3 + 0.01 * layer
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"run_name": "rh", "num_experts": 8, "moe_router_topk": 2}
    (run_dir / "run.json").write_text(json.dumps(meta))


def test_report_draws_router_health_and_names_the_layers_with_most_near_ties(tmp_path):
    from nemo_moe_metrics.report import render_report

    _write_run(tmp_path)
    summary = render_report(tmp_path).splitlines()
    head = next(line for line in summary if line.startswith("router health (last step)"))
    assert head == (
        "router health (last step): confidence 0.350, near ties 20.0% (worst layer 44.0%), "
        "|logit| max 2.5, max/ideal per microbatch 1.80 vs global batch 1.34"
    )
    reference = summary[summary.index(head) + 1]
    assert reference.startswith("reference: routing at random gives confidence 0.25 and entropy 1")
    # Six layers: the two (a third) with the most near ties, by their mean over the steps.
    assert "most near ties (mean over 5 steps): layer 2 40.2%, layer 6 30.2%" in summary
    assert (tmp_path / "router_health.png").stat().st_size > 10_000


def test_report_without_per_layer_keys_draws_the_summaries(tmp_path):
    from nemo_moe_metrics.report import render_report

    _write_run(tmp_path, per_layer=False)
    summary = render_report(tmp_path)
    assert "router health (last step)" in summary and "most near ties" not in summary
    assert (tmp_path / "router_health.png").stat().st_size > 10_000


def test_report_without_router_health_says_nothing_about_it(tmp_path):
    from nemo_moe_metrics.report import render_report

    _write_run(tmp_path, health=False)
    assert "router health" not in render_report(tmp_path)
    assert not (tmp_path / "router_health.png").exists()


def test_the_confidence_panel_has_a_reference_line_at_the_random_routing_level(
    tmp_path, monkeypatch
):
    # The summary says "routing at random gives confidence top_k/E"; the picture draws it.
    from matplotlib.figure import Figure

    from nemo_moe_metrics.report import render_report

    drawn = {}
    save = Figure.savefig

    def keep(fig, path, *args, **kwargs):
        drawn[str(path).rsplit("/", 1)[-1]] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    _write_run(tmp_path)
    render_report(tmp_path)
    confidence = drawn["router_health.png"].axes[0]
    random_level = 2 / 8  # top-2 of 8 experts, run.json above
    flat = [
        line
        for line in confidence.get_lines()
        if set(line.get_ydata()) == {random_level} and "random routing" in line.get_label()
    ]
    assert len(flat) == 1, [line.get_label() for line in confidence.get_lines()]
    assert "random routing" in [t.get_text() for t in confidence.get_legend().get_texts()][-1]
