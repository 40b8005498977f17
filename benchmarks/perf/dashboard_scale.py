"""The dashboard on a large fleet: its API, /metrics and the page in a real browser.

Writes a generated run folder (``--devices`` devices in ``fleet.json``, ``--rounds`` rows of
``metrics.jsonl``, a share of the devices with rejections and telemetry), serves it with the
real server (uvicorn, in a thread) and times over HTTP ``/api/fleet``, ``/api/rounds`` and
``/metrics``: the first request (the server parses and renders the files) and the median of
``--repeats`` more (the files unchanged: the server's cached answer). Then, where Debian's
``chromium`` is installed, the page from navigation to its first full render (fleet table,
charts) through the DevTools protocol, median of ``--repeats``; with ``--baseline REV``, the
page of that git revision (its ``edgefleet/dashboard/static``) is timed in the same browser,
alternately with today's, against the same server, and the ratio is in the line. Target
(issue 24): the page within 2 s at 1,000 devices.

    python -m benchmarks.perf.dashboard_scale                       # 1,000 devices, 200 rounds
    python -m benchmarks.perf.dashboard_scale --baseline 1f33bb8    # and the page as it was
    python -m benchmarks.perf.dashboard_scale --devices 50 --rounds 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.lib.browser import browser
from benchmarks.lib.grid import ROOT, emit
from edgefleet.dashboard.app import Dashboard


def make_run(run: Path, devices: int, rounds: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    fleet = {
        "format": 1,
        "written_at": time.time(),
        "round": rounds,
        "session": 1,
        "phase": "train",
        "test_accuracy": 0.9,
        "participants": [str(i) for i in range(25)],
        "declined": [],
        "rejected": [],
        "selected": [str(i) for i in range(25)],
        "task_vector_growth": 0.01,
        "stopping_tau": 0.005,
        "devices": [
            {
                "device": f"device-{i}",
                "node": 10_000 + i,
                "online": rng.random() < 0.9,
                "last_seen": rounds - rng.randrange(3),
                "battery": round(rng.uniform(0, 10), 2),
                "feasible": True,
                "present": None,
                "status_round": rounds,
                "labels": [i % 10],
                "participations": rng.randrange(rounds),
                "last_trained": rng.randrange(rounds),
                "declines": rng.randrange(5),
                "rejections": (
                    [{"round": 3, "reason": "update norm 25x the round's median"}]
                    if i % 50 == 0
                    else []
                ),
                "telemetry": {"cpu_temp": rng.uniform(40, 70), "load": rng.random()},
            }
            for i in range(devices)
        ],
    }
    (run / "fleet.json").write_text(json.dumps(fleet))
    rows = [
        {
            "round": r,
            "session": 1 + (r - 1) * 3 // rounds,
            "test_accuracy": 0.1 + 0.8 * r / rounds,
            "test_loss": 2.3 - 2 * r / rounds,
            "train_loss": 2.3 - 2 * r / rounds,
            "participants": [f"device-{i}" for i in rng.sample(range(devices), min(25, devices))],
            "declined": [],
            "rejected": [{"device": "device-0", "reason": "update norm 25x the round's median"}],
            "bytes_up": 2_000_000,
            "bytes_down": 2_000_000,
            "task_vector_growth": 0.05 / r,
        }
        for r in range(1, rounds + 1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def request_ms(url: str, repeats: int) -> tuple[float, float, int]:
    """The first request's milliseconds, the median of ``repeats`` more, and the body's size."""
    times, size = [], 0
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
    return round(1000 * times[0], 1), round(1000 * statistics.median(times[1:]), 1), size


def static_of(rev: str, into: Path) -> Path:
    """The dashboard's static folder as it was at git revision ``rev``."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "edgefleet/dashboard/static"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if not listing:
        raise SystemExit(f"--baseline {rev}: no edgefleet/dashboard/static at that revision")
    for name in listing:
        data = subprocess.run(
            ["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        path = into / Path(name).relative_to("edgefleet/dashboard/static")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return into


def page_render_s(urls: list[str], repeats: int, profile: Path) -> list[float] | None:
    """For each page, seconds from navigation to its first full render, median over
    ``repeats`` after one untimed load of each; the pages are loaded in turn, so that a change
    in the machine's load falls on each alike."""
    with browser(profile) as page:
        if page is None:
            return None

        def once(url: str) -> float | None:
            page.navigate("about:blank")
            t0 = time.perf_counter()
            page.navigate(url)
            while page.js("document.body && document.body.dataset.ready === '1'") is not True:
                if time.perf_counter() - t0 > 60:
                    return None
                time.sleep(0.01)
            return time.perf_counter() - t0

        for url in urls:  # untimed: the browser's first start of each page
            if once(url) is None:
                return None
        times: list[list[float]] = [[] for _ in urls]
        for _ in range(repeats):
            for i, url in enumerate(urls):
                t = once(url)
                if t is None:
                    return None
                times[i].append(t)
        return [round(statistics.median(t), 3) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default="", help="a git revision whose page to time too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgefleet-dashboard-") as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        make_run(run, args.devices, args.rounds)
        dashboards = [Dashboard(run, port=0, events_max_s=5).start()]
        if args.baseline:
            old = static_of(args.baseline, Path(tmp) / "baseline-static")
            dashboards.append(Dashboard(run, port=0, events_max_s=5, static=old).start())
        try:
            url = dashboards[0].url
            result: dict[str, Any] = {"fleet_json_bytes": (run / "fleet.json").stat().st_size}
            for name in ("api/fleet", "api/rounds", "metrics"):
                first, ms, size = request_ms(url + name, args.repeats)
                key = name.replace("/", "_")
                result[f"{key}_first_ms"] = first
                result[f"{key}_ms"] = ms
                result[f"{key}_bytes"] = size
            pages = page_render_s([d.url for d in dashboards], args.repeats, Path(tmp) / "profile")
            result["page_render_s"] = pages[0] if pages else None
            if args.baseline:
                result["baseline"] = args.baseline
                result["baseline_page_render_s"] = pages[1] if pages else None
                result["page_speedup"] = round(pages[1] / pages[0], 2) if pages else None
            result["page_target_s"] = 2.0
            result["load_avg_1m"] = round(os.getloadavg()[0], 2)
        finally:
            for d in dashboards:
                d.stop()
    emit("dashboard_scale", args, result, sizes=("devices", "rounds", "repeats"))


if __name__ == "__main__":
    main()
