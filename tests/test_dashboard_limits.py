"""The dashboard's bounds before its token check (docs/reference/service-limits.md), against a
real uvicorn server on a loopback port: an endless request head is cut off and costs bounded
memory, a slow one is closed at the head deadline, connections over the cap get 503; the
``?token=`` redirect stays on this site; the cookie holds a session value, never the token, and
is ``Secure`` behind a trusted TLS proxy. Waits are upper bounds (they return as soon as the
condition holds), sized for a loaded machine."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.perf.dashboard_limits import fleet as big_fleet
from edgefleet.dashboard import app as dashboard_app
from edgefleet.dashboard.app import COOKIE, Dashboard
from tests.test_dashboard import fleet, row

TOKEN = "s3cret"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "fleet.json").write_text(json.dumps(fleet(3, [7.0, 3.25, 0.0])))
    (run / "metrics.jsonl").write_text("".join(json.dumps(row(r)) + "\n" for r in (1, 2, 3)))
    return run


@pytest.fixture
def served(run_dir: Path) -> Iterator[Dashboard]:
    dashboard = Dashboard(run_dir, port=0, token=TOKEN, events_max_s=5).start()
    try:
        yield dashboard
    finally:
        dashboard.stop()


def _address(dashboard: Dashboard) -> tuple[str, int]:
    host, port = dashboard.sock.getsockname()[:2]
    return host, port


def _raw(address: tuple[str, int], request: bytes, timeout: float = 60.0) -> bytes:
    """The whole answer to ``request``, sent as is (no client library to tidy it up)."""
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _headers(answer: bytes) -> tuple[int, list[tuple[str, str]]]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    pairs = [tuple(part.strip() for part in line.split(":", 1)) for line in head[1:]]
    return status, [(k.lower(), v) for k, v in pairs]  # type: ignore[misc]


def _get(address: tuple[str, int], target: str, *headers: str) -> tuple[int, dict[str, str]]:
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: 127.0.0.1:{address[1]}",
        *headers,
        "Connection: close",
    ]
    status, pairs = _headers(_raw(address, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")))
    return status, dict(pairs)


# --- before the token: bounded head, bounded time, bounded connections -----------------------

ENDLESS_CAP = 48 * 1024 * 1024  # where a connection the server never cuts off is given up
CUT_OFF_WITHIN = 24 * 1024 * 1024  # the head cap plus what two loopback socket buffers hold


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_endless_header(address: tuple[str, int]) -> int:
    """Bytes an unfinished header got into the server before it answered or closed."""
    chunk = b"a" * 65536
    sent = 0
    with socket.create_connection(address, timeout=60) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Junk: ")
        while sent < ENDLESS_CAP:
            try:
                s.sendall(chunk)
            except (ConnectionResetError, BrokenPipeError):
                return sent
            sent += len(chunk)
            readable, _, _ = select.select([s], [], [], 0)
            if readable:  # the server's 400, or its FIN
                return sent
    return sent


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_an_endless_request_head_is_cut_off_and_costs_bounded_memory(run_dir: Path) -> None:
    # The dashboard as `edgefleet dashboard` runs it, in its own process (its RSS alone).
    # Before: uvicorn with httptools buffered each unfinished header whole, before the token
    # check (4 such connections took it from 36 to 430 MB).
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from edgefleet.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "dashboard", str(run_dir), "--port", "0",
         "--token", TOKEN],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split(": ", 1)[1].split(";")[0].strip()
        where = urllib.parse.urlsplit(url)
        address = (where.hostname or "", where.port or 0)
        assert _get(address, "/api/fleet", f"Authorization: Bearer {TOKEN}")[0] == 200
        before = _rss_kib(proc.pid)
        sent = [_send_endless_header(address) for _ in range(4)]
        grown_mib = (_rss_kib(proc.pid) - before) / 1024
        assert max(sent) < CUT_OFF_WITHIN, sent
        assert grown_mib < 20, f"RSS grew by {grown_mib:.0f} MiB ({sent} bytes sent)"
        # and it still answers
        assert _get(address, "/api/fleet", f"Authorization: Bearer {TOKEN}")[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_request_head_sent_a_byte_at_a_time_is_closed_at_the_deadline(run_dir: Path) -> None:
    dashboard = Dashboard(run_dir, port=0, token=TOKEN, header_timeout_s=0.5).start()
    try:
        with socket.create_connection(_address(dashboard), timeout=60) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            started = time.monotonic()
            closed = False
            while time.monotonic() - started < 60:
                try:
                    s.sendall(b"a")
                except (ConnectionResetError, BrokenPipeError):
                    closed = True
                    break
                readable, _, _ = select.select([s], [], [], 0.1)
                if readable:
                    closed = s.recv(1024) == b""
                    break
            assert closed, "a head trickling in was never closed"
            # A byte every 0.1 s: without the deadline it would go on; closed far sooner.
            assert time.monotonic() - started < 30
        # A whole request is answered as before (the deadline is for the head only).
        assert _get(_address(dashboard), "/api/fleet", f"Authorization: Bearer {TOKEN}")[0] == 200
    finally:
        dashboard.stop()


def test_connections_over_the_cap_are_answered_503(run_dir: Path) -> None:
    dashboard = Dashboard(run_dir, port=0, token=TOKEN, max_connections=3).start()
    address = _address(dashboard)
    auth = f"Authorization: Bearer {TOKEN}"
    try:
        idle = [socket.create_connection(address, timeout=60) for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while (status := _get(address, "/api/fleet", auth)[0]) != 503:
                assert time.monotonic() < deadline, f"never refused (last {status})"
                time.sleep(0.05)  # until the server has accepted the idle ones
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 60
        while (status := _get(address, "/api/fleet", auth)[0]) != 200:
            assert time.monotonic() < deadline, f"still refused once they closed ({status})"
            time.sleep(0.05)
    finally:
        dashboard.stop()


# --- the token's redirect and its cookie -----------------------------------------------------

OFF_SITE = [
    "//evil.example/",
    "///evil.example/",
    "/\\evil.example/",
    "/\\/evil.example/",
    "/%2F%2Fevil.example/",
    "/%5Cevil.example/",
    "/%5C%5Cevil.example/",
    "/%09/evil.example/",
    "/%0D%0ALocation:%20https://evil.example/",
    "https://evil.example/",
    "http://evil.example/x",
]


@pytest.mark.parametrize("target", OFF_SITE)
def test_the_token_redirect_stays_on_this_site(served: Dashboard, target: str) -> None:
    address = _address(served)
    status, headers = _get(address, f"{target}?token={TOKEN}")
    assert status == 303, (target, status)
    location = headers["location"]
    base = f"http://127.0.0.1:{address[1]}/"
    resolved = urllib.parse.urlsplit(urllib.parse.urljoin(base, location))
    assert (resolved.scheme, resolved.netloc) == ("http", f"127.0.0.1:{address[1]}"), location
    # What browsers also read as an authority: two slashes, either way round, or a
    # backslash; and no raw control character (a tab is dropped, a newline splits the head).
    assert location.startswith("/") and location[1:2] not in ("/", "\\"), location
    assert all(32 < ord(c) < 127 for c in location), location


def test_the_redirect_keeps_the_other_query_parameters(served: Dashboard) -> None:
    status, headers = _get(_address(served), f"/api/rounds?a=1&token={TOKEN}&b=x%2Fy")
    assert status == 303 and headers["location"] == "/api/rounds?a=1&b=x%2Fy"


def test_the_cookie_holds_a_session_value_not_the_token(served: Dashboard) -> None:
    address = _address(served)
    _, headers = _get(address, f"/?token={TOKEN}")
    cookie = headers["set-cookie"]
    value = cookie.split(";", 1)[0].split("=", 1)[1]
    assert TOKEN not in cookie and value == dashboard_app.session_value(TOKEN)
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie  # plain HTTP: a Secure cookie would never come back
    assert _get(address, "/api/fleet", f"Cookie: {COOKIE}={value}")[0] == 200
    assert _get(address, "/api/fleet", f"Cookie: {COOKIE}={TOKEN}")[0] == 401  # the raw token
    other = value[:-1] + ("1" if value.endswith("0") else "0")
    assert _get(address, "/api/fleet", f"Cookie: {COOKIE}={other}")[0] == 401
    assert dashboard_app.session_value("other") != value


def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(run_dir: Path) -> None:
    # The proxy (here 127.0.0.1, uvicorn's default trusted address) says the page was asked
    # over TLS: the cookie must then never travel over plain HTTP.
    proxied = "X-Forwarded-Proto: https"
    dashboard = Dashboard(run_dir, port=0, token=TOKEN).start()
    try:
        _, headers = _get(_address(dashboard), f"/?token={TOKEN}", proxied)
        assert "Secure" in headers["set-cookie"]
    finally:
        dashboard.stop()
    # From an address that is not the trusted proxy, the header is not believed.
    dashboard = Dashboard(run_dir, port=0, token=TOKEN, trusted_proxies="192.0.2.1").start()
    try:
        _, headers = _get(_address(dashboard), f"/?token={TOKEN}", proxied)
        assert "Secure" not in headers["set-cookie"]
    finally:
        dashboard.stop()


def test_the_bounds_need_no_client_library(served: Dashboard) -> None:
    # urllib (a real HTTP client) against the same server: the bounds leave normal use alone.
    request = urllib.request.Request(
        served.url + "api/fleet", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and json.load(reply)["round"] == 3
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(served.url + "api/fleet", timeout=60)
    assert err.value.code == 401


# --- /metrics: a bounded number of devices -------------------------------------------------


def _families(body: bytes) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_a_large_fleet_costs_a_bounded_scrape(tmp_path: Path) -> None:
    # Before: every device of fleet.json was exported (5,000 devices: 40,089 samples, 2.27 MB
    # a scrape), and the server's registry never forgets a device.
    from starlette.testclient import TestClient

    from edgefleet.dashboard.app import create_app
    from edgefleet.dashboard.metrics import MAX_DEVICES

    sizes = {}
    for n in (2_000, 5_000):
        run = tmp_path / f"run{n}"
        run.mkdir()
        (run / "fleet.json").write_text(json.dumps(big_fleet(n)))
        body = TestClient(create_app(run), base_url="http://127.0.0.1:8050").get("/metrics")
        sizes[n] = len(body.content)
        families = _families(body.content)
        per_device = {
            s.labels["device"]
            for name, f in families.items()
            if name.startswith("edgefleet_device_")
            for s in f.samples
        }
        assert len(per_device) == MAX_DEVICES
        assert families["edgefleet_devices"].samples[0].value == n  # the cut is visible
        assert families["edgefleet_devices_exported"].samples[0].value == MAX_DEVICES
        assert families["edgefleet_devices_export_limit"].samples[0].value == MAX_DEVICES
    assert max(sizes.values()) < 1_000_000, sizes
    assert sizes[5_000] <= sizes[2_000] * 1.01, sizes  # flat in the fleet's size


def test_offline_devices_leave_metrics_after_a_while() -> None:
    from edgefleet.dashboard.metrics import render_data

    def dev(name: str, online: bool, last_seen: int | None) -> dict:
        return {"device": name, "online": online, "last_seen": last_seen, "battery": 1.0}

    fleet = {
        "round": 50,
        "devices": [
            dev("gone-long-ago", False, 30),
            dev("never-seen", False, None),
            dev("just-left", False, 45),
            dev("here-old", True, 20),
            dev("here", True, 50),
        ],
    }

    def exported(**limits: int) -> list[str]:
        samples = _families(render_data(fleet, [], **limits))["edgefleet_device_battery"].samples
        return [s.labels["device"] for s in samples]

    assert sorted(exported()) == ["here", "here-old", "just-left"]  # default: 10 rounds
    assert sorted(exported(offline_rounds=3)) == ["here", "here-old"]
    # Over the cap: online first, then the most recently seen.
    assert exported(max_devices=2) == ["here", "here-old"]
    assert exported(max_devices=2, offline_rounds=100) == ["here", "here-old"]
    assert exported(max_devices=3, offline_rounds=100) == ["here", "here-old", "just-left"]


def test_per_device_samples_are_capped_whatever_the_fields() -> None:
    from edgefleet.dashboard.metrics import MAX_DEVICE_SAMPLES, MAX_LABEL, render_data

    fleet = big_fleet(300, telemetry=60)  # 66 samples a device: 19,800 in all
    for d in fleet["devices"]:
        d["device"] = d["device"] + "y" * 1_000  # ids far longer than a label needs
    families = _families(render_data(fleet, []))
    samples = [
        s for name, f in families.items() if name.startswith("edgefleet_device_") for s in f.samples
    ]
    assert len(samples) <= MAX_DEVICE_SAMPLES
    assert max(len(s.labels["device"]) for s in samples) == MAX_LABEL
    exported = families["edgefleet_devices_exported"].samples[0].value
    assert len({s.labels["device"] for s in samples}) == exported  # whole devices only
    assert exported == MAX_DEVICE_SAMPLES // 66 and len(samples) == exported * 66
