"""The dashboard's bounds, measured (docs/reference/service-limits.md).

1. Unfinished request heads: ``edgefleet dashboard`` (with a token) in its own process;
   ``--connections`` connections each send ``GET /`` and then a header that never ends, up
   to ``--endless-mb`` MB each. Reports the bytes each got in before the server answered or
   closed, and the server's RSS before and after (from ``/proc``).
2. ``/metrics`` of generated fleets of ``--fleets`` devices (each online, 4 telemetry fields,
   40-character ids): bytes and samples of one scrape.

    python -m benchmarks.perf.dashboard_limits
"""

from __future__ import annotations

import argparse
import select
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.lib.grid import emit
from edgefleet.dashboard.metrics import render_data

CHUNK = b"a" * 65536


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _endless(address: tuple[str, int], cap: int) -> int:
    sent = 0
    with socket.create_connection(address, timeout=120) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Junk: ")
        while sent < cap:
            try:
                s.sendall(CHUNK)
            except (ConnectionResetError, BrokenPipeError):
                break
            sent += len(CHUNK)
            if select.select([s], [], [], 0)[0]:
                break
    return sent


def endless_heads(connections: int, cap_mb: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        code = "import sys; from edgefleet.cli import main; sys.exit(main(sys.argv[1:]))"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "dashboard", tmp, "--port", "0", "--token", "t"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split(": ", 1)[1].split(";")[0].strip()
            where = urllib.parse.urlsplit(url)
            address = (where.hostname or "", where.port or 0)
            before = _rss_kib(proc.pid)
            sent = [_endless(address, cap_mb * 1024 * 1024) for _ in range(connections)]
            after = _rss_kib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "bytes_in_before_cut_off": sent,
        "cut_off": [n < cap_mb * 1024 * 1024 for n in sent],
        "rss_before_mib": round(before / 1024, 1),
        "rss_after_mib": round(after / 1024, 1),
    }


def fleet(n: int, rnd: int = 40, telemetry: int = 4) -> dict[str, Any]:
    """A ``fleet.json`` of ``n`` devices at round ``rnd``, each with ``telemetry`` fields (the
    shape the server writes; tests/test_dashboard_limits.py uses it too)."""
    devices = [
        {
            "device": f"board-{i:05d}-{'x' * 28}",
            "node": 10_000 + i,
            "online": True,
            "last_seen": rnd - (i % 7),
            "battery": float(i % 11),
            "participations": i % 13,
            "last_trained": rnd - 1,
            "declines": 0,
            "telemetry": {f"field_{k}": float(k) for k in range(telemetry)},
        }
        for i in range(n)
    ]
    return {"round": rnd, "session": 1, "devices": devices}


def scrapes(sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        body = render_data(fleet(n), [])
        text = body.decode()
        samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        out.append({"devices": n, "scrape_bytes": len(body), "samples": samples})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--endless-mb", type=int, default=100)
    parser.add_argument("--fleets", default="1000,5000,10000,20000")
    args = parser.parse_args()
    result = {
        "endless_heads": endless_heads(args.connections, args.endless_mb),
        "metrics": scrapes([int(x) for x in args.fleets.split(",")]),
    }
    emit("dashboard_limits", args, result, sizes=["connections", "endless_mb", "fleets"])


if __name__ == "__main__":
    main()
