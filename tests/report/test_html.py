"""report --html without a browser (report/html.py): what the page carries against the store
reader, long runs binned, the output rule, the html extra, the page's size."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from html_page_check import check_counts, embedded
from html_run import STEPS, streak_at, write_run

from nemo_moe_metrics.cli import main
from nemo_moe_metrics.report import html_data
from nemo_moe_metrics.report.html import GENERATOR, write_html_report
from nemo_moe_metrics.report.html_data import unpacked
from nemo_moe_metrics.run_dir.names import is_run_file
from nemo_moe_metrics.sinks.store import store_path

pytestmark = pytest.mark.one_line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("html") / "run")


def test_the_page_holds_every_stored_step_and_each_cells_dead_streak(run_dir):
    data = html_data.page_data(run_dir)
    check_counts(data, run_dir)
    counts = data["counts"]
    assert counts["width"] == 1 and counts["first"] == list(range(STEPS))
    streak = unpacked(counts["streak"])
    for k in range(STEPS):
        for row, layer in enumerate(counts["layers"]):
            for expert in range(counts["experts"]):
                assert streak[k, row, expert] == streak_at(k, layer, expert)


@pytest.mark.parametrize("limit", ["MAX_BINS", "CUBE_BYTES"])
def test_a_long_run_is_binned_by_the_pairwise_rule_and_says_so(run_dir, monkeypatch, limit):
    # A bin budget of 4 (or a byte budget of 1) on 12 logged steps: runs of 4 (or all 12).
    monkeypatch.setattr(html_data, limit, 4 if limit == "MAX_BINS" else 1)
    data = html_data.page_data(run_dir)
    check_counts(data, run_dir)  # each bin sums the store's counts of its steps
    counts = data["counts"]
    width = 4 if limit == "MAX_BINS" else 16
    assert counts["width"] == width and counts["size"] == [min(width, STEPS)] * (-(-STEPS // width))
    streak = unpacked(counts["streak"])  # the streak at the end of each bin
    for k, last in enumerate(counts["last"]):
        for row, layer in enumerate(counts["layers"]):
            want = [streak_at(last, layer, e) for e in range(counts["experts"])]
            assert streak[k, row].tolist() == want


def test_a_run_without_counts_still_gets_its_scalars_and_logged_balance(run_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("metrics.jsonl", "run.json"):
        (bare / name).write_bytes((run_dir / name).read_bytes())
    data = html_data.page_data(bare)
    assert data["counts"] is None and data["placement"] == []
    assert {c["id"] for c in data["scalars"]} >= {"throughput", "aux", "routing_layers"}


def test_the_command_refuses_a_symlinked_out_and_writes_nothing(run_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert main(["report", str(run_dir), "--html", "--out", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "symbolic link" in err and "give the real" in err
    assert list(target.iterdir()) == []


def test_the_command_never_replaces_a_report_html_it_did_not_write(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "report.html"
    mine.write_text("<html>my own notes</html>")
    assert main(["report", str(run_dir), "--html", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no report wrote it" in err
    assert mine.read_text() == "<html>my own notes</html>"
    assert sorted(p.name for p in out.iterdir()) == ["report.html"]  # no picture either


def test_a_page_it_wrote_is_replaced_and_never_through_a_link(run_dir, tmp_path):
    out = tmp_path / "out"
    first = write_html_report(run_dir, "first", out_dir=out)
    assert f'<meta name="generator" content="{GENERATOR}">' in first.read_text()
    again = write_html_report(run_dir, "second", out_dir=out)
    assert embedded(again)["summary"] == "second"
    again.unlink()
    (out / "report.html").symlink_to(tmp_path / "target.html")
    with pytest.raises(ValueError, match="symbolic link"):
        write_html_report(run_dir, "third", out_dir=out)
    assert not (tmp_path / "target.html").exists()
    assert is_run_file("report.html")  # the run's own: `run --overwrite` may delete it


def test_without_the_extra_the_command_names_it_in_one_line(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vl_convert", None)  # as if not installed
    assert main(["report", str(run_dir), "--html"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: nemo-moe-metrics report --html needs the 'html' extra (vl_convert is not "
        "installed); install it with: pip install 'nemo_moe_metrics[html]'"
    )
    assert not os.path.exists(run_dir / "report.html")


def test_the_page_stays_small_for_a_small_run(run_dir, tmp_path):
    page = write_html_report(run_dir, "s", out_dir=tmp_path)
    # The runtime (about 0.9 MB) and a few kB of data: the data is compact, not the rows.
    assert page.stat().st_size < 1_200_000
    assert store_path(run_dir).is_file()


def test_layers_with_fewer_experts_have_no_padding_cells_dead_or_counted(tmp_path):
    # A model whose MoE layers differ (4 and 8 experts): the columns past a layer's own experts
    # are no expert, so neither dead nor in its max/ideal.
    from nemo_moe_metrics.sinks.jsonl import METRICS_FILE, JsonlSink
    from nemo_moe_metrics.sinks.store import ExpertLoadStore

    run = tmp_path / "mixed"
    run.mkdir()
    sink = JsonlSink(run / METRICS_FILE, fsync=False)
    with ExpertLoadStore(store_path(run), fsync=False) as store:
        for step in range(3):
            counts = np.array([[5, 1, 1, 1, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 0]])
            store.append(step, [4, 2], counts, widths=[4, 8])  # layer 4 first: sorted on the page
            sink.log({"train_perf/tokens": 8.0}, step)
    sink.close()
    data = html_data.page_data(run)
    check_counts(data, run)
    counts = data["counts"]
    assert counts["layers"] == [2, 4] and counts["widths"] == [8, 4]
    dead = [row[-1] for row in counts["stats"]["dead"]]
    assert dead == [1, 0]  # layer 2's expert 7 got nothing; layer 4's columns 4-7 are none
    moi = [row[-1] for row in counts["stats"]["max_over_ideal"]]
    assert moi == pytest.approx([7 * 8 / 28, 5 * 4 / 8])
    streak = unpacked(counts["streak"])
    assert streak[-1, 0, 7] == 3 and streak[-1, 1, 4:].tolist() == [0, 0, 0, 0]
