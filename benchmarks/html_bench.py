#!/usr/bin/env python
"""``report --html`` over a long run: ``python benchmarks/html_bench.py RUN [--loads 3]``.

Writes the page with the command itself (``nemo-moe-metrics report RUN --html --out DIR``, in
its own process, as a user runs it), then opens it in headless Chromium (tests/support/browser.py:
Debian's ``chromium``, network off) ``loads`` times, each in a fresh tab, and reads when the
first chart was drawn (``window.nmm.firstChartMs``: milliseconds from the start of the page's
navigation to the heatmap's first render). In ``benchmarks/run.py`` the run is
``long_run.py``'s 10,000 steps at 94 x 256 with a table every step (``report_bench`` writes it;
nothing is generated twice), so the page holds its largest cube.

Keys: ``html_report_mb_10k_94x256`` (MB, 1e6 bytes) and ``html_first_chart_s`` (median over the
loads). Without Chromium they are absent and ``details`` says why.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "nemo_moe_metrics").is_dir():
    sys.path.insert(0, str(_REPO))


def html_bench(run_dir: Path, out_dir: Path, *, loads: int = 3) -> dict:
    """``{"html_report_mb": ..., "html_first_chart_s": ..., "checks": {...}, "details": {...}}``
    (the two numbers absent without a browser)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "nemo_moe_metrics.cli", "report", str(run_dir), "--html"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "--out", str(out_dir)], capture_output=True, text=True, env=env, timeout=900
    )
    command_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    page = out_dir / "report.html"
    checks = {"html_exit_0": proc.returncode == 0 and page.is_file()}
    details: dict = {
        "command_seconds": command_s,  # pictures, summary and page, as a user waits
        "command_cpu_seconds": cpu_s,
        "stderr_tail": proc.stderr[-500:],
    }
    if not checks["html_exit_0"]:
        return {"checks": checks, "details": details}
    result: dict = {"html_report_mb": page.stat().st_size / 1e6}
    details["bytes"] = page.stat().st_size
    sys.path.insert(0, str(_REPO / "tests" / "support"))
    from browser import Browser, BrowserUnavailable

    try:
        browser = Browser()
    except BrowserUnavailable as err:
        details["browser"] = f"not measured: {err}"
        return {**result, "checks": checks, "details": details}
    firsts, walls, errors, requests = [], [], [], []
    try:
        details["browser"] = browser.version
        for _ in range(loads):
            tab = browser.new_page()
            t0 = time.perf_counter()
            tab.call("Page.navigate", {"url": page.resolve().as_uri()})
            tab.wait_for("window.nmm && (window.nmm.firstChartMs || window.nmm.errors.length)", 120)
            walls.append(time.perf_counter() - t0)
            firsts.append(tab.eval("window.nmm.firstChartMs") / 1e3)
            tab.wait_for("window.nmm.done || window.nmm.errors.length", 120)
            errors += tab.console_errors() + tab.eval("window.nmm.errors")
            requests += [u for u in tab.requests() if u != page.resolve().as_uri()]
            details.setdefault("timings_ms", tab.eval("window.nmm.timings"))
            tab.close()
    finally:
        browser.close()
    result["html_first_chart_s"] = statistics.median(firsts)
    checks["html_no_page_errors"] = not errors
    checks["html_fetches_nothing"] = not requests
    details.update(
        first_chart_s=firsts,
        navigate_to_first_chart_s=walls,
        errors=errors[:5],
        load_average_1m=os.getloadavg()[0],
    )
    return {**result, "checks": checks, "details": details}


def main(argv: list[str] | None = None) -> int:
    """Measure one run's page and print the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="run directory (benchmarks/long_run.py writes one)")
    parser.add_argument("--out", type=Path, default=None, help="page folder (default RUN/html)")
    parser.add_argument("--loads", type=int, default=3, help="page loads to time (3)")
    args = parser.parse_args(argv)
    out = args.out or args.run / "html"
    print(json.dumps(html_bench(args.run, out, loads=args.loads), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
