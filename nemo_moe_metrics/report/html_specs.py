"""The charts of ``report --html``: Vega-Lite specs whose data sets are named, which the page
fills (and refills when the step slider or the layer picker moves) through Vega's View API.

:func:`compiled` turns one into Vega with the runtime's own Vega-Lite version (the page then
does no compiling) and makes the marks that only decorate (lines, alert rules, outlines,
shading; layers named ``decor...``) deaf to the mouse: Vega's canvas hands the pointer to the
first mark whose area holds it, and a line's area is the polygon it encloses, so over a line
chart no point, and under an outline no cell, would ever show its tooltip.

Colours follow the report's PNGs: a cell's load over the ideal on a log2 scale centred on 1
(white balanced, red overloaded, blue underloaded), black for an expert that got no token.
"""

from __future__ import annotations

from typing import Any

#: The heatmaps' cells are drawn this size at most / at least (pixels).
CELL_PX = (3, 28)
HEATMAP_PX = (960, 600)  # the heatmap's width and height at most
LINE_PX = (640, 220)

# What the heatmap tooltips show, in this order (the browser tests read them by title).
TOOLTIP_TITLES = {
    "layer": "layer",
    "expert": "expert",
    "tokens": "tokens",
    "load": "load % of the layer",
    "ratio": "load / ideal",
    "streak": "dead streak (logged steps)",
    "steps": "steps",
}


#: Marks of these types never take the pointer (see the module's docstring).
DEAF_MARKS = ("line", "rule")

# No ARIA description per mark: Vega-Lite would format one string per cell (24,000 of them at
# 94 x 256), which doubles the heatmap's drawing time; the tooltips carry the numbers.
_CONFIG: dict[str, Any] = {"aria": False, "view": {"stroke": None}}


def _cell(total_px: int, n: int) -> int:
    return int(max(CELL_PX[0], min(CELL_PX[1], total_px // max(1, n))))


def _ordinal_axis(title: str, n: int, every: int) -> dict[str, Any]:
    axis: dict[str, Any] = {"title": title, "labelOverlap": True}
    if n > 2 * every:
        axis["labelExpr"] = f"datum.value % {every} === 0 ? datum.label : ''"
    return axis


def _load_colour(limit: float) -> dict[str, Any]:
    return {
        "condition": {"test": "datum.tokens === 0", "value": "black"},
        "field": "lr",
        "type": "quantitative",
        "title": "log2(load / ideal)",
        "scale": {"scheme": "redblue", "reverse": True, "domain": [-limit, limit], "clamp": True},
    }


def _tooltip(*fields: str) -> list[dict[str, Any]]:
    formats = {"tokens": ",", "load": ".3f", "ratio": ".3f"}
    out = []
    for f in fields:
        item: dict[str, Any] = {"field": f, "title": TOOLTIP_TITLES[f]}
        if f in formats:
            item["format"] = formats[f]
            item["type"] = "quantitative"
        out.append(item)
    return out


def heatmap_spec(
    layer_ids: list[int], experts: int, limit: float, picker: bool = True, px: int = HEATMAP_PX[0]
) -> dict[str, Any]:
    """MoE layer (rows) x expert (columns), data ``cells`` (``layer, expert, tokens, load,
    ratio, lr, streak, steps``); with ``picker``, the picked layer (data ``pick``) is outlined
    and the tooltip says the cell's dead streak; ``px``: the width at most. The domains are
    given, not gathered from 24,000 cells each time the step moves."""
    layers = len(layer_ids)
    cw, ch = _cell(px, experts), _cell(HEATMAP_PX[1], layers)
    shown = ("layer", "expert", "tokens", "load", "ratio", "streak", "steps")
    y = {"field": "layer", "type": "ordinal", "scale": {"domain": list(layer_ids)}}
    cells = {
        "data": {"name": "cells"},
        "mark": {"type": "rect"},
        "encoding": {
            "x": {"field": "expert", "type": "ordinal", "scale": {"domain": list(range(experts))},
                  "axis": _ordinal_axis("expert", experts, 16)},
            "y": {**y, "axis": _ordinal_axis("MoE layer", layers, 5)},
            "color": _load_colour(limit),
            "tooltip": _tooltip(*(f for f in shown if picker or f != "streak")),
        },
    }  # fmt: skip
    spec: dict[str, Any] = {"width": cw * experts, "height": ch * layers, "config": _CONFIG}
    if not picker:
        return {**spec, **cells}
    pick = {
        "name": "decor_pick",
        "data": {"name": "pick"},
        "mark": {"type": "rect", "fill": None, "stroke": "#222", "strokeWidth": 2},
        "encoding": {"y": y},
    }
    return {**spec, "layer": [cells, pick]}


def layer_steps_spec(experts: int, limit: float, steps: tuple[float, float]) -> dict[str, Any]:
    """One layer's experts (rows) over step bins (columns ``x0..x1`` within ``steps``), data
    ``lcells``; the bins the main heatmap shows are outlined (data ``window``)."""
    ch = _cell(360, experts)
    x_scale = {"domain": list(steps), "zero": False, "nice": False}
    cells = {
        "data": {"name": "lcells"},
        "mark": {"type": "rect"},
        "encoding": {
            "x": {"field": "x0", "type": "quantitative", "title": "training step",
                  "scale": x_scale},
            "x2": {"field": "x1"},
            "y": {"field": "expert", "type": "ordinal", "scale": {"domain": list(range(experts))},
                  "axis": _ordinal_axis("expert", experts, 16)},
            "color": _load_colour(limit),
            "tooltip": _tooltip("layer", "expert", "steps", "tokens", "load", "ratio", "streak"),
        },
    }  # fmt: skip
    window = {
        "name": "decor_window",
        "data": {"name": "window"},
        "mark": {"type": "rect", "fill": None, "stroke": "#222", "strokeWidth": 2},
        "encoding": {"x": {"field": "x0", "type": "quantitative"}, "x2": {"field": "x1"}},
    }
    return {
        "width": HEATMAP_PX[0] * 2 // 3,
        "height": ch * experts,
        "config": _CONFIG,
        "layer": [cells, window],
    }


def lines_spec(
    x_title: str, y_title: str, *, alerts: bool = True, cursor: bool = False
) -> dict[str, Any]:
    """Series over x, data ``lines`` (``x, y, series``); with ``alerts``, a red rule at each
    alert's step (data ``alerts``: ``step, message``); with ``cursor``, the steps the
    heatmap shows shaded (data ``window``: ``x0, x1``)."""
    layers: list[dict[str, Any]] = [
        {
            "data": {"name": "lines"},
            "mark": {"type": "line", "point": {"size": 12}, "strokeWidth": 1.5},
            "encoding": {
                "x": {"field": "x", "type": "quantitative", "title": x_title,
                      "scale": {"zero": False}},
                "y": {"field": "y", "type": "quantitative", "title": y_title,
                      "scale": {"zero": False}},
                "color": {"field": "series", "type": "nominal", "sort": None,
                          "legend": {"orient": "right", "title": None, "labelLimit": 260}},
                "tooltip": [{"field": "series", "title": "series"},
                            {"field": "x", "title": x_title},
                            {"field": "y", "title": y_title, "format": ".4g"}],
            },
        }
    ]  # fmt: skip
    if cursor:
        layers.insert(
            0,
            {
                "name": "decor_window",
                "data": {"name": "window"},
                "mark": {"type": "rect", "color": "#888", "opacity": 0.18},
                "encoding": {"x": {"field": "x0", "type": "quantitative"}, "x2": {"field": "x1"}},
            },
        )
    if alerts:  # a dashed rule across, and a triangle on top to hover for the message
        x = {"field": "step", "type": "quantitative"}
        tip = [{"field": "step", "title": "alert at step"}, {"field": "message", "title": "alert"}]
        layers += [
            {
                "data": {"name": "alerts"},
                "mark": {"type": "rule", "color": "#d62728", "strokeDash": [3, 3], "opacity": 0.6},
                "encoding": {"x": x},
            },
            {
                "data": {"name": "alerts"},
                "mark": {"type": "point", "shape": "triangle-down", "filled": True, "size": 90,
                         "color": "#d62728", "yOffset": 6},
                "encoding": {"x": x, "y": {"value": 0}, "tooltip": tip},
            },
        ]  # fmt: skip
    return {"width": LINE_PX[0], "height": LINE_PX[1], "config": _CONFIG, "layer": layers}


def compiled(spec: dict[str, Any], vl_version: str) -> dict[str, Any]:
    """``spec`` compiled to Vega (needs vl-convert-python), its decorating marks made deaf to
    the pointer."""
    import vl_convert as vlc

    vega = vlc.vegalite_to_vega(spec, vl_version=vl_version)

    def quiet(marks: list[dict[str, Any]]) -> None:
        for mark in marks:
            inner = mark.get("marks", [])
            quiet(inner)
            deaf = mark.get("type") in DEAF_MARKS or str(mark.get("name", "")).startswith("decor")
            # A group of deaf marks (a line's facets) would take the pointer over its area.
            if deaf or (inner and all(m.get("interactive") is False for m in inner)):
                mark["interactive"] = False

    quiet(vega.get("marks", []))
    return vega
