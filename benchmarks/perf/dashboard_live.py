"""The dashboard beside a real run: what a new user sees after ``edgefleet run SCENARIO
--dashboard`` (issue 24's "done when").

Starts the run as a user would (``edgefleet run`` in a subprocess, Flower's Simulation Engine
unless ``--engine inprocess``), opens the page it prints in headless Chromium as soon as the
URL is printed, and every ``--every`` seconds reads the page's state from the DOM, never
reloading it, beside ``metrics.jsonl`` on disk. Prints one JSON line: the rounds the page showed
(each distinct count of rows it had drawn, in order), how far it trailed the file when read
(rounds), whether its last state equals the files (last round's accuracy, every device's row
and battery from ``fleet.json``), and two screenshots' paths (mid-run and after the end).

    python -m benchmarks.perf.dashboard_live                  # scenarios/default.toml, 30 rounds
    python -m benchmarks.perf.dashboard_live --scenario scenarios/fedavg.toml --engine inprocess
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.browser import browser
from benchmarks.lib.grid import ROOT, emit
from benchmarks.lib.overrides import add_set_arg, parse_sets
from edgefleet.server.results import read_rows

# What the page has drawn (the attributes the page's own code sets; tests/test_dashboard.py
# reads the same ones).
PAGE_STATE = """JSON.stringify({
  ready: document.body.dataset.ready || null,
  rows: document.body.dataset.rows || null,
  devices: [...document.querySelectorAll('#fleet tbody tr')].map(tr => [
    tr.dataset.device, tr.querySelector('td[data-col=battery]').textContent]),
  accuracy: [...document.querySelectorAll('#accuracy-last span')].map(s => [
    s.dataset.series, Number(s.dataset.round), Number(s.dataset.value)]),
})"""


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_rows(path) if path.exists() else []  # a cut-short last line is left out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="scenarios/default.toml")
    p.add_argument("--engine", default="simulation", choices=("simulation", "inprocess"))
    p.add_argument("--every", type=float, default=2.0, help="seconds between reads of the page")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-dashboard-live"))
    add_set_arg(p)
    args = p.parse_args()
    parse_sets(p, args.set)  # a misspelt key stops here, not after the run has started
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sets = ["--set", f"output-dir={out}", "--set", "run-name=live"]
    for kv in args.set:
        sets += ["--set", kv]
    run = out / "live"
    log = out / "run.log"
    cmd = [sys.executable, "-m", "edgefleet.cli", "run", args.scenario, "--dashboard"]
    cmd += ["--engine", args.engine, *sets]
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = None
        while url is None:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                sys.exit(f"no dashboard URL in {log}; the run ended or took too long")
            found = re.search(r"dashboard: (http://\S+)", log.read_text())
            url = found.group(1) if found else None
            time.sleep(0.2)
        url_s = time.monotonic() - t0
        with browser(out / "profile") as page:
            if page is None:
                sys.exit("needs Debian's chromium and the websockets package")
            page.navigate(url)
            reads: list[dict[str, Any]] = []
            shot_mid = None
            while True:
                ended = proc.poll() is not None
                on_disk = len(_rows(run / "metrics.jsonl"))
                state = json.loads(page.js(PAGE_STATE) or "{}")
                shown = int(state["rows"]) if state.get("rows") else None
                reads.append({"t": round(time.monotonic() - t0, 1), "file": on_disk,
                              "page": shown})  # fmt: skip
                if shot_mid is None and shown and shown >= 2 and not ended:
                    shot_mid = out / "live-mid.png"
                    page.screenshot(shot_mid)
                if ended:
                    break
                time.sleep(args.every)
            # After the end: the page's last refresh, then its state against the files.
            rows = _rows(run / "metrics.jsonl")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = json.loads(page.js(PAGE_STATE) or "{}")
                if state.get("rows") == str(len(rows)):
                    break
                time.sleep(0.5)
            page.screenshot(out / "live-end.png")
        fleet = json.loads((run / "fleet.json").read_text())["devices"]
        shown_batteries = {d: b for d, b in state.get("devices", [])}
        accuracy = {n: (r, v) for n, r, v in state.get("accuracy", [])}
        last = rows[-1] if rows else {}
        seen = [r["page"] for r in reads if r["page"] is not None]
        distinct = [n for i, n in enumerate(seen) if i == 0 or n != seen[i - 1]]
        trail = [r["file"] - r["page"] for r in reads if r["page"] is not None]
        result = {
            "scenario": args.scenario,
            "engine": args.engine,
            "exit_code": proc.wait(),
            "rounds": len(rows),
            "url_after_s": round(url_s, 1),
            "reads": len(reads),
            "page_rows_seen": distinct,
            "rounds_drawn_without_reload": len(distinct),
            "page_trailed_file_rounds_max": max(trail) if trail else None,
            "final_rows_equal": state.get("rows") == str(len(rows)),
            "final_accuracy_equal": accuracy.get("test_accuracy")
            == (last.get("round"), last.get("test_accuracy")),
            "devices_in_fleet_json": len(fleet),
            "device_rows_shown": len(shown_batteries),
            "batteries_equal": all(
                d.get("battery") is None or float(shown_batteries[d["device"]]) == d["battery"]
                for d in fleet
                if d["device"] in shown_batteries
            )
            and len(shown_batteries) == len(fleet),
            "screenshots": [str(s) for s in (shot_mid, out / "live-end.png") if s],
        }
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    emit("dashboard_live", args, result, sizes=("every", "scenario", "engine", "set"))
    ok = result["final_rows_equal"] and result["final_accuracy_equal"] and result["batteries_equal"]
    sys.exit(0 if ok and result["exit_code"] == 0 else 1)


if __name__ == "__main__":
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    main()
