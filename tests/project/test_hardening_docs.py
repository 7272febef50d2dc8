"""The troubleshooting page quotes real messages, and the scale page's numbers are recomputed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# A quote is checked when it follows one of these labels directly ("Message (from torch): ..."
# quotes a third-party text and is not checked); several quotes may follow, joined by commas.
LABELLED = re.compile(
    r"(?:Messages?|Warning|Log line|note|message|消息|警告|日志行|附注)[:：]\s*"
    r"((?:`[^`]+`(?:[,，、]?\s*(?:and|then|with|和|然后|并附带)?\s*)?)+)"
)


def _quoted_messages(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [q for chain in LABELLED.findall(flat) for q in re.findall(r"`([^`]+)`", chain)]


def _package_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "nemo_moe_metrics").rglob("*.py")))


def test_troubleshooting_quotes_at_least_fifty_messages():
    quotes = _quoted_messages((DOCS / "en" / "troubleshooting.md").read_text(encoding="utf-8"))
    assert len(quotes) >= 50, quotes


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_quoted_message_occurs_in_the_package_source(lang):
    source = _package_source()
    text = (DOCS / lang / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [q for q in _quoted_messages(text) if q not in source]
    assert not missing, f"docs/{lang}/troubleshooting.md quotes text the code never says: {missing}"


def test_chinese_troubleshooting_quotes_the_same_messages():
    en, zh = (
        _quoted_messages((DOCS / lang / "troubleshooting.md").read_text(encoding="utf-8"))
        for lang in ("en", "zh")
    )
    assert sorted(en) == sorted(zh)


def _scale_sizes() -> tuple[int, int]:
    """Expert-load payload bytes and one rank's pickled signature at 94 layers x 256 experts."""
    import pickle

    from nemo_moe_metrics.moe.reduction import ExpertLoadReducer, LayerSignature, Signature

    sig = Signature(0, tuple(LayerSignature(layer, 256, 8) for layer in range(94)))
    reducer = ExpertLoadReducer()
    reducer._agree(sig, world=1)  # the layout a real first export agrees on
    return reducer._size * 8, len(pickle.dumps(sig))  # int64 slots; torch pickles likewise


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_scale_page_states_the_payload_sizes_the_code_makes(lang):
    payload, signature = _scale_sizes()
    # routed counts, executed counts, routed tokens, zero-computation picks, two guard slots
    assert payload == (2 * 94 * 256 + 2 * 94 + 2) * 8
    text = (DOCS / lang / "scale.md").read_text(encoding="utf-8")
    assert f"{payload:,} bytes" in text or f"{payload:,} 字节" in text
    assert f"{signature} bytes" in text or f"{signature} 字节" in text
    assert f"{1024 * signature:,}" in text
