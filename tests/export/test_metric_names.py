"""The metric-name contract (export/metric_names.py): every key it defines is in the metric
reference of docs/en and docs/zh."""

from pathlib import Path

import pytest

from nemo_moe_metrics.export import metric_names as mn

DOCS = Path(__file__).resolve().parents[2] / "docs"

LANGS = ("en", "zh")


@pytest.mark.parametrize("lang", LANGS)
def test_metric_reference_lists_every_documented_key(lang):
    text = (DOCS / lang / "metrics.md").read_text(encoding="utf-8")
    missing = [k for k in mn.documented_key_patterns() if f"`{k}`" not in text]
    assert not missing, f"docs/{lang}/metrics.md lacks {missing}"
