"""Vega-Lite and full Vega specs of the expert-load heatmap, for W&B custom charts and elsewhere.

Shipped as package data beside this module, per chart:

- ``<chart>.vl.json``: Vega-Lite v5, reading the table columns by their own names from a data
  source named ``wandb`` (paste into any Vega-Lite tool after pointing ``data`` at the rows);
- ``<chart>.vg.json``: the same chart compiled to full Vega v5, with every column reference
  written as a W&B field placeholder (``${field:layer}``): paste it into a W&B custom chart
  (the editor works in Vega) and map the fields to the table's columns, see ``WANDB_FIELDS``.

Charts: ``expert_load_heatmap`` (one ``moe/expert_loads`` table, e.g. the run's
``summaryTable``) and ``expert_load_heatmap_steps`` (a ``historyTable`` of every logged step,
with a step strip to pick the step shown). ``python -m nemo_moe_metrics.charts --write``
regenerates the Vega files from the Vega-Lite ones (needs ``vl-convert-python``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_moe_metrics.export.metric_names import EXPERT_LOAD_COLUMNS

CHART_DIR = Path(__file__).resolve().parent
CHARTS: tuple[str, ...] = ("expert_load_heatmap", "expert_load_heatmap_steps")
# The step column of the history chart; W&B's historyTable calls it ``_step``.
STEP_FIELD = "step"
# The Vega-Lite version the shipped Vega specs are compiled from.
VEGA_LITE_VERSION = "5.20"

# W&B field name -> the column it maps to in what this package logs. The history chart also
# needs ``step``, mapped to the step column of W&B's historyTable (``_step``).
WANDB_FIELDS: dict[str, str] = {c: c for c in EXPERT_LOAD_COLUMNS}
WANDB_HISTORY_FIELDS: dict[str, str] = {**WANDB_FIELDS, STEP_FIELD: "_step"}


def _chart_fields(chart: str) -> tuple[str, ...]:
    if chart not in CHARTS:
        raise ValueError(f"unknown chart {chart!r}; choose one of {list(CHARTS)}")
    fields = tuple(EXPERT_LOAD_COLUMNS)
    return (*fields, STEP_FIELD) if chart.endswith("_steps") else fields


def vega_lite_spec(chart: str) -> dict[str, Any]:
    """The shipped Vega-Lite spec of ``chart`` (columns under their own names)."""
    _chart_fields(chart)
    return json.loads((CHART_DIR / f"{chart}.vl.json").read_text())


def vega_spec(chart: str) -> dict[str, Any]:
    """The shipped full Vega spec of ``chart``, with W&B ``${field:...}`` placeholders."""
    _chart_fields(chart)
    return json.loads((CHART_DIR / f"{chart}.vg.json").read_text())


def placeholder(field: str) -> str:
    """The W&B custom-chart placeholder of a field: ``${field:<name>}``."""
    return "${field:" + field + "}"


def _with_placeholders(node: Any, fields: tuple[str, ...]) -> Any:
    """Every column reference of a Vega-Lite spec rewritten as a W&B placeholder."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "field" and isinstance(value, str) and value in fields:
                out[key] = placeholder(value)
            elif key in ("groupby", "fields") and isinstance(value, list):
                out[key] = [
                    placeholder(v) if isinstance(v, str) and v in fields else v for v in value
                ]
            else:
                out[key] = _with_placeholders(value, fields)
        return out
    if isinstance(node, list):
        return [_with_placeholders(v, fields) for v in node]
    if isinstance(node, str):
        # Expressions read columns as datum['name'] (the spec's convention).
        return re.sub(
            r"datum\['([A-Za-z_][A-Za-z0-9_]*)'\]",
            lambda m: f"datum['{placeholder(m.group(1))}']" if m.group(1) in fields else m.group(0),
            node,
        )
    return node


def compile_wandb_vega(chart: str) -> dict[str, Any]:
    """Compile ``chart``'s Vega-Lite spec to the W&B Vega spec (needs vl-convert-python)."""
    import vl_convert as vlc

    spec = _with_placeholders(vega_lite_spec(chart), _chart_fields(chart))
    return vlc.vegalite_to_vega(spec, vl_version=VEGA_LITE_VERSION)


def fill_fields(spec: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """``spec`` with each ``${field:name}`` replaced by ``fields[name]``, as W&B does.

    A placeholder without a mapping raises, naming the fields to map.
    """
    text = json.dumps(spec)
    found = set(re.findall(r"\$\{field:([^}]+)\}", text))
    missing = sorted(found - set(fields))
    if missing:
        raise ValueError(
            f"the spec's fields {missing} have no mapping; map every one of {sorted(found)} "
            "to a column of the table"
        )
    for name, column in fields.items():
        # json.dumps escapes the column as a JSON string body (quotes stripped).
        text = text.replace(placeholder(name), json.dumps(column)[1:-1])
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    """Regenerate ``<chart>.vg.json`` from ``<chart>.vl.json`` (or check them with --check)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help="overwrite the .vg.json files")
    args = parser.parse_args(argv)
    stale = []
    for chart in CHARTS:
        text = json.dumps(compile_wandb_vega(chart), indent=1) + "\n"
        path = CHART_DIR / f"{chart}.vg.json"
        if args.write:
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(path.name)
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m nemo_moe_metrics.charts --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
