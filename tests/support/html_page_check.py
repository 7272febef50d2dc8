"""Checks of a ``report --html`` page against the run's store, shared by the page's own tests
and by the tests of every path that writes a run (main job, TRL, Megatron-Bridge, torchtitan).

Expected values come from the store reader (``read_expert_loads``), never from the code that
built the page. In the browser, the numbers are read where a user reads them: the tooltip that
a real mouse move over a drawn cell opens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from nemo_moe_metrics.report.html import write_html_report
from nemo_moe_metrics.report.html_data import unpacked
from nemo_moe_metrics.sinks.store import read_expert_loads, store_path

# The page's data element and the JavaScript that finds a drawn mark of a view by its datum.
_DATA = re.compile(r'<script type="application/json" id="nmm-data">(.*?)</script>', re.S)
FIND_MARK = """
((id, want, fy, marktype) => {
  const view = nmm.views[id];
  view.container().scrollIntoView({ block: "center" });  // the mouse reaches the viewport only
  const canvas = view.container().querySelector("canvas").getBoundingClientRect();
  const pad = view.padding();  // drawn at the canvas's corner + padding + origin
  const [ox, oy] = [view.origin()[0] + pad.left, view.origin()[1] + pad.top];
  const same = (d) => d && Object.entries(want).every(([k, v]) => d[k] === v);
  let hit = null;
  (function walk(mark, x0, y0) {  // a group item offsets the marks inside it
    for (const item of mark.items || []) {
      if (mark.marktype === "group") {
        for (const child of item.items || []) walk(child, x0 + (item.x || 0), y0 + (item.y || 0));
      } else if (same(item.datum) && (!marktype || mark.marktype === marktype)) {
        const b = item.bounds;  // within its bounds: centred across, fy down
        hit = { x: canvas.left + ox + x0 + (b.x1 + b.x2) / 2,
                y: canvas.top + oy + y0 + b.y1 + fy * (b.y2 - b.y1), datum: item.datum };
      }
    }
  })(view.scenegraph().root, 0, 0);
  return hit;
})
"""
TOOLTIP = """
(() => {
  const el = document.getElementById("vg-tooltip-element");
  if (!el || !el.classList.contains("visible")) return null;
  const out = {};
  for (const tr of el.querySelectorAll("tr")) {
    const cells = tr.querySelectorAll("td");
    if (cells.length === 2) out[cells[0].textContent.replace(/:$/, "")] = cells[1].textContent;
  }
  return out;
})()
"""


def embedded(page: Path) -> dict[str, Any]:
    """The data a page carries (its JSON element), as the page's script reads it."""
    found = _DATA.search(page.read_text(encoding="utf-8"))
    assert found, f"{page} has no data element"
    return json.loads(found[1])


def store_steps(run_dir: Path) -> dict[int, tuple[list[int], np.ndarray]]:
    """``step -> (layer ids, counts [L, E])`` from the store reader."""
    return {
        int(step): ([int(i) for i in ids], counts)
        for step, ids, counts in read_expert_loads(store_path(run_dir))
    }


def check_counts(data: dict[str, Any], run_dir: Path) -> dict[int, tuple[list[int], np.ndarray]]:
    """The page's counts cube sums the store's counts over each bin's steps, layer for layer
    (in ascending layer order), and its bins cover every stored step once, in order."""
    stored = store_steps(run_dir)
    counts = data["counts"]
    cube = unpacked(counts["counts"])
    steps = sorted(stored)
    assert sum(counts["size"]) == len(steps)
    start = 0
    for k, size in enumerate(counts["size"]):
        chunk = steps[start : start + size]
        start += size
        assert (counts["first"][k], counts["last"][k]) == (chunk[0], chunk[-1])
        for step in chunk:
            ids, _ = stored[step]
            assert sorted(ids) == counts["layers"]
        want = sum(stored[s][1][np.argsort(stored[s][0])] for s in chunk)
        np.testing.assert_array_equal(cube[k, :, : want.shape[1]], want)
    return stored


def hover(
    page: Any,
    view: str,
    want: dict[str, Any],
    shows: tuple[str, str] | None = None,
    marktype: str = "",
) -> dict[str, str]:
    """Move the mouse onto the middle of the drawn mark of ``view`` whose datum matches
    ``want`` (of ``marktype`` when given: ``symbol``, ``rect``); the tooltip's rows (title ->
    shown text) once it shows ``shows`` (title, text; default: the layer of ``want``)."""
    hit = page.eval(f"{FIND_MARK}('{view}', {json.dumps(want)}, 0.5, '{marktype}')")
    assert hit, f"no drawn mark of {view} with {want}"
    page.mouse_move(hit["x"] + 1, hit["y"] + 1)  # a move, then onto the spot: hover events
    page.mouse_move(hit["x"], hit["y"])
    title, text = shows or ("layer", str(want["layer"]))
    return page.wait_for(
        f"(() => {{ const t = {TOOLTIP.strip()}; "
        f"return t && t[{json.dumps(title)}] === {json.dumps(text)} ? t : null; }})()",
        timeout=10,
    )


def number(text: str) -> float:
    """A tooltip's number (``1,234`` or ``12.500``) as a float."""
    return float(text.replace(",", ""))


def check_page(run_dir: Path, browser: Any = None, out_dir: Path | None = None) -> Path:
    """Write ``report.html`` of ``run_dir`` and check its counts against the store; with a
    browser, open it offline: no error, nothing fetched, and the tooltip over the last step's
    busiest cell of the first layer shows the store's tokens. Returns the page."""
    page_path = write_html_report(Path(run_dir), "summary", out_dir=out_dir)
    data = embedded(page_path)
    stored = check_counts(data, run_dir)
    if browser is None:
        return page_path
    page = browser.new_page()
    try:
        page.open(page_path)
        page.wait_for("window.nmm && (window.nmm.done || window.nmm.errors.length)", 60)
        assert page.eval("window.nmm.errors") == []
        assert page.console_errors() == []
        assert page.requests() == [page_path.resolve().as_uri()]
        last = max(stored)
        ids, counts = stored[last]
        row = int(np.argmin(ids))
        expert = int(np.argmax(counts[row]))
        if data["counts"]["size"][-1] == 1:  # the last bin is the last step alone
            tip = hover(page, "heatmap", {"layer": ids[row], "expert": expert})
            assert number(tip["tokens"]) == counts[row, expert]
    finally:
        page.close()
    return page_path
