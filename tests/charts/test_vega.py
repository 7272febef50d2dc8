"""The shipped heatmap specs, rendered by the real Vega engine on a real W&B offline table.

The main job runs once (session fixture); its ``moe/expert_loads`` tables are read back from
the W&B offline run's files. Each spec (Vega-Lite, and the W&B Vega with its field
placeholders filled as W&B fills them) is rendered to a scenegraph with vl-convert, and every
(layer, expert) cell is checked: present once, at the position of its layer and expert, with
load/ideal equal to the table's (computed here from the table's own tokens and load_percent).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from nemo_moe_metrics import charts
from nemo_moe_metrics.export.metric_names import EXPERT_LOAD_COLUMNS

vlc = pytest.importorskip("vl_convert")

CELL = re.compile(
    r"^(?:step (?P<step>\d+), )?layer (?P<layer>\d+), expert (?P<expert>\d+): "
    r"(?P<tokens>\d+) tokens, load/ideal (?P<load>\S+)$"
)
BAR = re.compile(r"^step (?P<step>\d+): max load/ideal (?P<load>\S+)$")
RENAMED = {"layer": "L", "expert": "E", "tokens": "T", "load_percent": "P", "step": "_step"}


@pytest.fixture(scope="module")
def wandb_tables(main_job_run) -> dict[int, list[list]]:
    """step -> rows of the moe/expert_loads table, read back from the W&B offline run."""
    files = list(main_job_run.glob("wandb/offline-run-*/files/media/table/moe/expert_loads_*"))
    tables = {}
    for path in files:
        step = int(re.fullmatch(r"expert_loads_(\d+)_[0-9a-f]+\.table\.json", path.name)[1])
        table = json.loads(path.read_text())
        assert table["columns"] == list(EXPERT_LOAD_COLUMNS)
        tables[step] = table["data"]
    assert sorted(tables) == [0, 1, 2], files
    return tables


def _expected(rows) -> dict[tuple[int, int], tuple[int, float]]:
    """(layer, expert) -> (tokens, load/ideal), from the table alone."""
    layer_tokens: dict[int, int] = defaultdict(int)
    experts: dict[int, int] = defaultdict(int)
    for layer, _expert, tokens, _pct in rows:
        layer_tokens[layer] += tokens
        experts[layer] += 1
    out = {}
    for layer, expert, tokens, pct in rows:
        load = tokens * experts[layer] / layer_tokens[layer]
        # The table's own percentage says the same: load/ideal = percent x experts / 100.
        assert load == pytest.approx(pct * experts[layer] / 100, rel=1e-12)
        out[(layer, expert)] = (tokens, load)
    return out


def _items(scenegraph, pattern):
    """Rendered mark items whose description matches ``pattern``: (match, item)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            match = pattern.match(str(node.get("description", "")))
            if match and "x" in node:
                found.append((match, node))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(scenegraph)
    return found


def _check_cells(scenegraph, rows, step=None):
    expected = _expected(rows)
    cells = _items(scenegraph, CELL)
    got = {}
    for match, item in cells:
        key = (int(match["layer"]), int(match["expert"]))
        assert key not in got, f"cell {key} drawn twice"
        if step is not None:
            assert int(match["step"]) == step
        got[key] = (int(match["tokens"]), float(match["load"]), item["x"], item["y"])
    assert set(got) == set(expected)
    for key, (tokens, load) in expected.items():
        assert got[key][:2] == (tokens, load), key
    # Each cell sits in its expert's column and its layer's row, both in ascending order.
    cols: dict[int, set] = defaultdict(set)
    rows_y: dict[int, set] = defaultdict(set)
    for (layer, expert), (_, _, x, y) in got.items():
        cols[expert].add(x)
        rows_y[layer].add(y)
    assert all(len(v) == 1 for v in [*cols.values(), *rows_y.values()])
    xs = [cols[e].pop() for e in sorted(cols)]
    ys = [rows_y[layer].pop() for layer in sorted(rows_y)]
    assert xs == sorted(set(xs)) and ys == sorted(set(ys))


def _dicts(rows, names=EXPERT_LOAD_COLUMNS, step=None, step_name="step"):
    out = [dict(zip(names, r, strict=True)) for r in rows]
    if step is not None:
        for d in out:
            d[step_name] = step
    return out


def _history(tables, names=EXPERT_LOAD_COLUMNS, step_name="step"):
    return [d for s in sorted(tables) for d in _dicts(tables[s], names, s, step_name)]


def _vega_with_data(spec, values, store=None):
    spec = json.loads(json.dumps(spec))
    for data in spec["data"]:
        if data["name"] == "wandb":
            data["values"] = values
        if store is not None and data["name"] == "picked_store":
            data["values"] = store
    return spec


# --- the snapshot heatmap (one table) ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_vega_lite_heatmap_draws_every_cell_of_the_wandb_table(wandb_tables):
    rows = wandb_tables[2]
    spec = charts.vega_lite_spec("expert_load_heatmap")
    spec["data"] = {"values": _dicts(rows)}
    scenegraph = vlc.vegalite_to_scenegraph(spec, vl_version=charts.VEGA_LITE_VERSION)
    _check_cells(scenegraph, rows)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_wandb_vega_heatmap_draws_every_cell_through_the_field_mapping(wandb_tables):
    rows = wandb_tables[2]
    names = [RENAMED[c] for c in EXPERT_LOAD_COLUMNS]  # columns named unlike the fields
    spec = charts.fill_fields(charts.vega_spec("expert_load_heatmap"), RENAMED)
    scenegraph = vlc.vega_to_scenegraph(_vega_with_data(spec, _dicts(rows, names)))
    _check_cells(scenegraph, rows)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_wandb_vega_heatmap_with_the_documented_mapping(wandb_tables):
    rows = wandb_tables[1]
    spec = charts.fill_fields(charts.vega_spec("expert_load_heatmap"), charts.WANDB_FIELDS)
    scenegraph = vlc.vega_to_scenegraph(_vega_with_data(spec, _dicts(rows)))
    _check_cells(scenegraph, rows)


# --- the step selector over the history table ---------------------------------------------


def _check_step_bars(scenegraph, tables):
    bars = {int(m["step"]): float(m["load"]) for m, _ in _items(scenegraph, BAR)}
    expected = {s: max(load for _, load in _expected(rows).values()) for s, rows in tables.items()}
    assert bars == expected


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_vega_lite_step_heatmap_shows_the_last_step_by_default(wandb_tables):
    spec = charts.vega_lite_spec("expert_load_heatmap_steps")
    spec["data"] = {"values": _history(wandb_tables)}
    scenegraph = vlc.vegalite_to_scenegraph(spec, vl_version=charts.VEGA_LITE_VERSION)
    _check_cells(scenegraph, wandb_tables[2], step=2)
    _check_step_bars(scenegraph, wandb_tables)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_wandb_vega_step_heatmap_shows_the_last_step_by_default(wandb_tables):
    names = [RENAMED[c] for c in EXPERT_LOAD_COLUMNS]
    spec = charts.fill_fields(charts.vega_spec("expert_load_heatmap_steps"), RENAMED)
    values = _history(wandb_tables, names, step_name="_step")
    scenegraph = vlc.vega_to_scenegraph(_vega_with_data(spec, values))
    _check_cells(scenegraph, wandb_tables[2], step=2)
    _check_step_bars(scenegraph, wandb_tables)


def _signal_value(node, name):
    """The initial value of the signal ``name`` anywhere in a Vega spec (marks nest signals)."""
    if isinstance(node, dict):
        for signal in node.get("signals", []):
            if signal.get("name") == name:
                return signal["value"]
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        value = _signal_value(child, name)
        if value is not None:
            return value
    return None


@pytest.mark.parametrize("picked", [0, 1])
@pytest.mark.slow
@pytest.mark.timeout(450)
def test_wandb_vega_step_heatmap_shows_the_picked_step(wandb_tables, picked):
    names = [RENAMED[c] for c in EXPERT_LOAD_COLUMNS]
    spec = charts.fill_fields(charts.vega_spec("expert_load_heatmap_steps"), RENAMED)
    values = _history(wandb_tables, names, step_name="_step")
    # What a click on step ``picked``'s bar stores (the tuple the spec's click handler builds).
    fields = _signal_value(spec, "picked_tuple_fields")
    store = [{"unit": "concat_0", "fields": fields, "values": [picked]}]
    scenegraph = vlc.vega_to_scenegraph(_vega_with_data(spec, values, store))
    _check_cells(scenegraph, wandb_tables[picked], step=picked)


# --- the shipped files ----------------------------------------------------------------------


def test_shipped_vega_specs_are_compiled_from_the_vega_lite_specs():
    for chart in charts.CHARTS:
        assert charts.vega_spec(chart) == charts.compile_wandb_vega(chart), (
            f"{chart}.vg.json is stale: run python -m nemo_moe_metrics.charts --write"
        )


def test_wandb_vega_specs_read_columns_only_through_field_placeholders():
    for chart in charts.CHARTS:
        spec = charts.vega_spec(chart)
        text = json.dumps(spec)
        wanted = {"layer", "expert", "tokens", "load_percent"}
        if chart.endswith("_steps"):
            wanted.add("step")
        assert set(re.findall(r"\$\{field:([^}]+)\}", text)) == wanted
        assert "wandb" in [d["name"] for d in spec["data"]]


def test_unmapped_field_is_named_in_the_error():
    spec = charts.vega_spec("expert_load_heatmap_steps")
    with pytest.raises(ValueError, match=r"fields \['step'\] have no mapping"):
        charts.fill_fields(spec, charts.WANDB_FIELDS)
