"""The docs cover every metric key, link every docs page, and ship a usable Vega-Lite spec."""

import json
import re
from pathlib import Path

import pytest

from nemo_moe_metrics.export import metric_names as mn

DOCS = Path(__file__).resolve().parents[2] / "docs"

LANGS = ("en", "zh")

# Every page in docs/en (the index aside) is linked from both indexes.
INDEXED = sorted(p.name for p in (DOCS / "en").glob("*.md") if p.name != "index.md")


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.mark.parametrize("lang", LANGS)
def test_index_links_every_docs_page(lang):
    text = (DOCS / lang / "index.md").read_text(encoding="utf-8")
    links = set(re.findall(r"\]\(([^)#]+)\)", text))
    assert set(INDEXED) <= links, f"docs/{lang}/index.md lacks {set(INDEXED) - links}"
    dead = [link for link in links if not (DOCS / lang / link).resolve().is_file()]
    assert not dead, f"docs/{lang}/index.md links missing pages {dead}"


def test_every_english_page_has_a_chinese_translation():
    assert sorted(p.name for p in (DOCS / "zh").glob("*.md")) == sorted(
        p.name for p in (DOCS / "en").glob("*.md")
    )


def test_vega_lite_spec_is_valid_json_over_the_table_columns():
    text = (DOCS / "en" / "visualisation.md").read_text(encoding="utf-8")
    (block,) = _code_blocks(text, "json")
    spec = json.loads(block)
    assert "vega-lite" in spec["$schema"]
    derived = {t["as"] for t in spec["transform"] if "calculate" in t}
    derived |= {a["as"] for t in spec["transform"] for a in t.get("joinaggregate", [])}
    fields = {v["field"] for v in spec["encoding"].values() if isinstance(v, dict) and "field" in v}
    fields |= {t["field"] for t in spec["encoding"]["tooltip"]}
    assert fields - derived <= set(mn.EXPERT_LOAD_COLUMNS), fields - derived
    assert {"layer", "expert"} <= fields
    # The page shows the shipped spec (tests/charts/test_vega.py renders that one).
    from nemo_moe_metrics import charts

    assert spec == charts.vega_lite_spec("expert_load_heatmap")


@pytest.mark.parametrize("page", ["metrics.md", "visualisation.md", "index.md"])
def test_chinese_page_mirrors_the_english_structure(page):
    en = (DOCS / "en" / page).read_text(encoding="utf-8")
    zh = (DOCS / "zh" / page).read_text(encoding="utf-8")
    heading_levels = [re.findall(r"^(#+) ", t, re.M) for t in (en, zh)]
    assert heading_levels[0] == heading_levels[1]
    # Code, commands and the chart spec are shared verbatim, not translated.
    assert re.findall(r"```.*?```", en, re.S) == re.findall(r"```.*?```", zh, re.S)
    keys = [set(re.findall(r"`((?:moe|train_perf)/[^`\n]*)`", t)) for t in (en, zh)]
    assert keys[0] == keys[1], keys[0] ^ keys[1]


@pytest.mark.parametrize("lang", LANGS)
def test_the_alert_record_the_docs_show_is_what_the_jsonl_sink_writes(lang, tmp_path):
    from nemo_moe_metrics.sinks.alerts import Alert
    from nemo_moe_metrics.sinks.jsonl import JsonlSink

    text = (DOCS / lang / "visualisation.md").read_text(encoding="utf-8")
    (block,) = [b for b in _code_blocks(text, " *jsonl") if '"alerts"' in b]
    shown = json.loads(" ".join(block.split()))
    scalars = {k: v for k, v in shown.items() if k not in ("step", "alerts")}
    alerts = [Alert(step=shown["step"], **a).record() for a in shown["alerts"]]
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(scalars, shown["step"], alerts)
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == shown
    assert list(shown)[-1] == "alerts"


@pytest.mark.parametrize("lang", LANGS)
def test_integration_and_frameworks_pages_match_the_files_they_name(lang):
    import re

    root = DOCS.parent
    integration = (DOCS / lang / "integration.md").read_text(encoding="utf-8")
    listed = re.findall(r"^- `(examples/integrate_\w+\.py)`", integration, re.M)
    assert len(listed) == 3 and all((root / f).is_file() for f in listed), listed
    assert ("Three runnable files" if lang == "en" else "三个可运行的文件") in integration
    assert (
        "table_every" in integration
        and "## " + ("Mistakes that raise" if lang == "en" else "会报错的误用") in integration
    )
    frameworks = (DOCS / lang / "frameworks.md").read_text(encoding="utf-8")
    fqns = set(re.findall(r'worker_extension_cls_fqn="([^"]+)"', frameworks))
    assert fqns == {"my_pkg.workers.MoEMetricsWorker"}, fqns  # prose and code name one path
    assert "## Hugging Face transformers" in frameworks
    assert "examples/integrate_hf_fsdp.py" in frameworks


def test_every_page_gives_the_same_number_of_hugging_face_moe_model_types():
    # The count the pages state is the one hf_families discovers in the installed transformers.
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from hf_families import moe_families

    pages = [DOCS.parent / "README.md", *sorted((DOCS / "en").glob("*.md"))]
    pages += sorted((DOCS / "zh").glob("*.md"))
    stated = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for n in re.findall(r"(\d+) (?:MoE )?model types|(\d+) (?:种|个)模型类型", text):
            stated.setdefault(int("".join(n)), []).append(page.name)
    assert set(stated) == {len(moe_families())}, stated
