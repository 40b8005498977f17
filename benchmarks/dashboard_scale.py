"""The dashboard on a large fleet: its API, /metrics and the page in a real browser.

Writes a generated run folder (``--devices`` devices in ``fleet.json``, ``--rounds`` rows of
``metrics.jsonl``, a share of the devices with rejections and telemetry), serves it with the
real server (uvicorn, in a thread) and times, as the median of ``--repeats`` requests over
HTTP: ``/api/fleet``, ``/api/rounds``, ``/metrics``; then, where Debian's ``chromium`` is
installed, the page from navigation to its first full render (fleet table, charts) through
the DevTools protocol. Target (issue 24): the page within 2 s at 1,000 devices.

    python benchmarks/dashboard_scale.py                       # 1,000 devices, 200 rounds
    python benchmarks/dashboard_scale.py --devices 50 --rounds 10 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import emit

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


def median_ms(url: str, repeats: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            size = len(r.read())
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 1), size


def page_render_s(url: str, repeats: int, profile: Path) -> float | None:
    """Seconds from navigation to the page's first full render, median over ``repeats``."""
    try:
        from websockets.sync.client import connect
    except ImportError:
        return None
    chromium = shutil.which("chromium")
    if chromium is None:
        return None
    args = [chromium, "--headless", "--disable-gpu", "--remote-debugging-port=0"]
    args += [f"--user-data-dir={profile}", "--window-size=1400,1700", "about:blank"]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")
    browser = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        target = next(t for t in targets if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=2**26) as ws:
            ids = iter(range(1, 10**9))

            def call(method: str, **params: Any) -> Any:
                n = next(ids)
                ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    reply = json.loads(ws.recv(timeout=30))
                    if reply.get("id") == n:
                        return reply.get("result", {})

            times = []
            for _ in range(repeats):
                call("Page.navigate", url="about:blank")
                t0 = time.perf_counter()
                call("Page.navigate", url=url)
                while True:
                    ready = call(
                        "Runtime.evaluate",
                        expression="document.body && document.body.dataset.ready === '1'",
                        returnByValue=True,
                    )
                    if ready.get("result", {}).get("value") is True:
                        break
                    if time.perf_counter() - t0 > 60:
                        return None
                    time.sleep(0.01)
                times.append(time.perf_counter() - t0)
        return round(statistics.median(times), 3)
    finally:
        browser.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            browser.wait(10)
        if browser.poll() is None:
            browser.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgefleet-dashboard-") as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        make_run(run, args.devices, args.rounds)
        dashboard = Dashboard(run, port=0, events_max_s=5).start()
        try:
            result: dict[str, Any] = {"fleet_json_bytes": (run / "fleet.json").stat().st_size}
            for name in ("api/fleet", "api/rounds", "metrics"):
                ms, size = median_ms(dashboard.url + name, args.repeats)
                result[f"{name.replace('/', '_')}_ms"] = ms
                result[f"{name.replace('/', '_')}_bytes"] = size
            result["page_render_s"] = page_render_s(
                dashboard.url, args.repeats, Path(tmp) / "profile"
            )
            result["page_target_s"] = 2.0
        finally:
            dashboard.stop()
    emit("dashboard_scale", args, result, sizes=("devices", "rounds", "repeats"))


if __name__ == "__main__":
    main()
