"""``nemo-moe-metrics report RUN_DIR --html``: one self-contained ``report.html``.

The page holds everything it needs: the Vega, Vega-Lite and vega-embed runtime, inlined from
the pinned ``vl-convert-python`` package (the ``html`` extra; nothing is vendored here), the
run's data (:mod:`~nemo_moe_metrics.report.html_data`, compressed), the chart specs
(:mod:`~nemo_moe_metrics.report.html_specs`) and the script that draws them
(``html_page.js``). It opens from the file system with no network.

Where it goes: ``report.html`` in the run directory, or in ``--out DIR``. It is never written
through a symbolic link (the directory or the file), and a ``report.html`` that this command
did not write (it has no :data:`GENERATOR` mark) is never replaced.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.report.html_data import page_data, unpacked
from nemo_moe_metrics.report.html_specs import (
    compiled,
    heatmap_spec,
    layer_steps_spec,
    lines_spec,
)
from nemo_moe_metrics.report.pictures import colour_limit, log_ratio
from nemo_moe_metrics.report.reading import ReportError, Window
from nemo_moe_metrics.run_dir.names import REPORT_PAGE_FILE
from nemo_moe_metrics.run_dir.outputs import OutputError, check_report_page
from nemo_moe_metrics.runtime.durable import write_text_durably
from nemo_moe_metrics.runtime.extras import require

__all__ = [
    "GENERATOR",
    "MAX_PAGE_BYTES",
    "REPORT_PAGE_FILE",
    "check_page_target",
    "page_html",
    "vega_runtime",
    "write_html_report",
]

#: The mark in every page this command writes; a ``report.html`` without it is not replaced.
GENERATOR = "nemo_moe_metrics report --html"
#: What the page's size is held under for a 10,000-step run at 94 x 256 (docs, benchmark).
MAX_PAGE_BYTES = 8 << 20
_HERE = Path(__file__).resolve().parent


_WHAT = "nemo-moe-metrics report --html"  # who needs the extra, in its error


def check_page_target(run_dir: Path, out_dir: Path | None) -> Path:
    """The page's path (``report.html`` in ``out_dir``, else in ``run_dir``), checked by the
    output rule (:func:`~nemo_moe_metrics.run_dir.outputs.check_report_page`) before anything
    is written; :class:`ReportError` saying the fix otherwise."""
    folder = Path(out_dir) if out_dir is not None else Path(run_dir)
    try:
        return check_report_page(folder, REPORT_PAGE_FILE, _ours)
    except OutputError as err:
        raise ReportError(str(err)) from None


def _ours(page: Path) -> bool:
    try:
        with page.open("rb") as f:
            head = f.read(2048)
    except OSError:
        return False
    return f'<meta name="generator" content="{GENERATOR}">'.encode() in head


@functools.lru_cache(maxsize=1)
def vega_runtime() -> tuple[str, str, str]:
    """The inlined runtime (vega-embed, Vega-Lite and Vega as one script that sets
    ``window.vegaEmbed``), a line naming its versions and its Vega-Lite version (the specs
    are compiled with it); built once per process (seconds)."""
    vlc = require("vl_convert", "html", _WHAT)
    from importlib.metadata import version

    vl_version = vlc.get_vegalite_versions()[-1]
    bundle = vlc.javascript_bundle(vl_version=vl_version)
    if "</script" in bundle.lower():  # would end the inline <script> early
        bundle = bundle.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    versions = (
        f"Vega {vlc.get_vega_version()}, Vega-Lite {vl_version}, "
        f"vega-embed {vlc.get_vega_embed_version()} (vl-convert-python "
        f"{version('vl-convert-python')})"
    )
    return bundle, versions, vl_version


def _colour_limit(counts: dict[str, Any]) -> float:
    sums = unpacked(counts["counts"]).astype(np.int64)
    widths = np.asarray(counts["widths"])
    uniform = int(widths.min()) == sums.shape[2]
    _, last = log_ratio(sums[-1], None if uniform else widths)
    _, every = log_ratio(sums, None if uniform else widths)
    return colour_limit(last, every)


def _specs(data: dict[str, Any], vl_version: str) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    counts = data["counts"]
    alerts = bool(data["alerts"]["marks"])  # no alert layer without alerts (an empty axis)
    if counts is not None:
        limit = _colour_limit(counts)
        experts = counts["experts"]
        specs["heatmap"] = heatmap_spec(counts["layers"], experts, limit)
        steps = (counts["first"][0] - 0.5, counts["last"][-1] + 0.5)
        specs["layer_steps"] = layer_steps_spec(experts, limit, steps)
        cursor = dict(alerts=alerts, cursor=True)
        specs["moi"] = lines_spec("training step", "busiest expert / ideal", **cursor)
        specs["cv"] = lines_spec("training step", "coefficient of variation", **cursor)
        specs["dead"] = lines_spec("training step", "experts with 0 tokens", **cursor)
    for chart in data["scalars"]:
        specs[chart["id"]] = lines_spec("training step", chart["y"], alerts=alerts)
    for p in data["placement"]:
        experts = p["tokens"]["shape"][1]
        specs[f"{p['phase']}_loads"] = heatmap_spec(p["layers"], experts, 3.0, picker=False, px=460)
        specs[f"{p['phase']}_sweep"] = lines_spec(
            "redundant experts R", "balancedness (mean / max GPU load)", alerts=False
        )
        specs[f"{p['phase']}_plan"] = lines_spec(
            "MoE layer", "balancedness (mean / max GPU load)", alerts=False
        )
    return {name: compiled(spec, vl_version) for name, spec in specs.items()}


def _json_for_script(value: Any) -> str:
    # Inside <script>, "</script>" or "<!--" in a string would end or confuse the element.
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def page_html(data: dict[str, Any], summary: str) -> str:
    """The whole page for ``data`` (:func:`~nemo_moe_metrics.report.html_data.page_data`) and
    the report's text ``summary``."""
    runtime, versions, vl_version = vega_runtime()
    payload = {**data, "summary": summary, "specs": _specs(data, vl_version), "runtime": versions}
    script = (_HERE / "html_page.js").read_text(encoding="utf-8")
    style = (_HERE / "html_page.css").read_text(encoding="utf-8")
    title = _escape(f"{data['run']}: MoE report")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="generator" content="{GENERATOR}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        # No request may leave the file: scripts and styles inline, images as data only.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
        'img-src data: blob:">\n'
        f"<title>{title}</title>\n<style>{style}</style>\n</head>\n<body>\n"
        f'<script type="application/json" id="nmm-data">{_json_for_script(payload)}</script>\n'
        f"<script>{runtime}</script>\n<script>{script}</script>\n</body>\n</html>\n"
    )


def write_html_report(
    run_dir: Path,
    summary: str,
    *,
    out_dir: Path | None = None,
    steps: Window | None = None,
    layers: list[int] | None = None,
) -> Path:
    """Write ``report.html`` for ``run_dir`` (into ``out_dir`` when given) and return its path.
    ``summary`` is the text ``report`` prints (shown at the top); ``steps`` and ``layers`` as
    for :func:`~nemo_moe_metrics.report.render_report` (``layers``: the layer picked first)."""
    require("vl_convert", "html", _WHAT)
    page = check_page_target(run_dir, out_dir)
    text = page_html(page_data(Path(run_dir), steps=steps, layers=layers), summary)
    page.parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(page, text)
    return page


def size_text(path: Path) -> str:
    """``1.2 MB``: a page's size for the command's last line."""
    mb = os.path.getsize(path) / 1e6
    return f"{mb:.{1 if mb >= 1 else 2}f} MB"
