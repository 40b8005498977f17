"""The dashboard (edgefleet/dashboard) on a hand-made run folder: its endpoints, the token, the
refusal to serve the network without one, hostile device strings, /metrics in Prometheus'
format; then the page in a real headless Chromium (a new round appears without a reload) and
a real Prometheus server scraping /metrics. Nothing here starts Flower or Ray."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from edgefleet.cli import main
from edgefleet.dashboard.app import (
    COOKIE,
    TOKEN_ENV,
    Dashboard,
    DashboardError,
    check_bind,
    create_app,
)
from edgefleet.dashboard.metrics import reason_kind
from edgefleet.fileio import atomic_write_text

HOSTILE_ID = '<img src=x onerror="window.__pwned=1">'
HOSTILE_REASON = (
    "metric 'num-examples' must be a whole number, got '<script>window.__pwned=2</script>'"
)
LOOPBACK = "http://127.0.0.1:8050"


def device(name: str, battery: Any, **extra: Any) -> dict[str, Any]:
    return {
        "device": name,
        "node": 100 + len(name),
        "online": True,
        "last_seen": 3,
        "battery": battery,
        "feasible": True,
        "present": None,
        "status_round": 3,
        "labels": [0, 1],
        "participations": 2,
        "last_trained": 3,
        "declines": 0,
        "rejections": [],
        **extra,
    }


def fleet(rnd: int, batteries: list[float]) -> dict[str, Any]:
    devices = [device(str(i), b) for i, b in enumerate(batteries)]
    devices[1]["telemetry"] = {"cpu_temp": 47.5, "load": 0.25, "platform": "aarch64"}
    devices.append(
        device(HOSTILE_ID, 1.5, rejections=[{"round": 2, "reason": HOSTILE_REASON}], online=False)
    )
    return {
        "format": 1,
        "written_at": 1_700_000_000.0 + rnd,
        "round": rnd,
        "session": 1,
        "phase": "train",
        "test_accuracy": 0.5 + rnd / 100,
        "participants": ["0", "1", "2"],
        "declined": [],
        "rejected": [],
        "selected": ["0", "1", "2"],
        "task_vector_growth": 0.02 / rnd,
        "stopping_tau": 0.005,
        "devices": devices,
    }


def row(rnd: int) -> dict[str, Any]:
    return {
        "round": rnd,
        "session": 1,
        "test_accuracy": 0.5 + rnd / 100,
        "test_loss": 2.0 - rnd / 10,
        "participants": ["0", "1", "2"],
        "declined": ["2"] if rnd == 1 else [],
        "rejected": [{"device": HOSTILE_ID, "reason": HOSTILE_REASON}] if rnd == 2 else [],
        "bytes_up": 1000 * rnd,
        "bytes_down": 2000,
        "energy_spent": 1.0,
        "train_loss": 2.1 - rnd / 10,
        "federated": {"eval-accuracy": 0.4 + rnd / 100, "eval-loss": 2.2},
        "task_vector_growth": 0.02 / rnd,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "fleet.json").write_text(json.dumps(fleet(3, [7.0, 3.25, 0.0])))
    (run / "metrics.jsonl").write_text("".join(json.dumps(row(r)) + "\n" for r in (1, 2, 3)))
    return run


def client(run_dir: Path, token: str | None = None) -> TestClient:
    return TestClient(create_app(run_dir, token, events_max_s=0.05), base_url=LOOPBACK)


# --- the app, in process ---------------------------------------------------------------------


def test_endpoints_serve_the_run_folder(run_dir: Path) -> None:
    c = client(run_dir)
    page = c.get("/")
    assert page.status_code == 200 and "static/dashboard.js" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert c.get("/api/fleet").json() == json.loads((run_dir / "fleet.json").read_text())
    assert [r["round"] for r in c.get("/api/rounds").json()] == [1, 2, 3]
    assert c.get("/api/summary").json() == {"run": "run", "summary": {}}
    events = c.get("/events")
    assert events.headers["content-type"].startswith("text/event-stream")
    assert "event: change\ndata: " in events.text
    for path in (
        "dashboard.js",
        "dashboard.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.LICENSE",
    ):
        assert c.get(f"/static/{path}").status_code == 200, path


def test_a_64_bit_node_id_reaches_the_page_exactly(run_dir: Path) -> None:
    # Flower's node ids are 64-bit; a JavaScript number holds 53 bits, so the page showed
    # 6004891191586305998 (a real run's node) as 6004891191586306000. They go as strings.
    data = fleet(3, [7.0, 3.25, 0.0])
    data["devices"][0]["node"] = 6004891191586305998
    data["devices"][1]["node"] = 12  # small enough: stays a number
    (run_dir / "fleet.json").write_text(json.dumps(data))
    got = client(run_dir).get("/api/fleet").json()["devices"]
    assert got[0]["node"] == "6004891191586305998" and got[1]["node"] == 12
    assert got[0]["battery"] == 7.0 and got[0]["online"] is True


def test_a_folder_without_files_yet_reads_as_empty(tmp_path: Path) -> None:
    c = client(tmp_path)
    assert c.get("/api/fleet").json() == {}
    assert c.get("/api/rounds").json() == []
    assert c.get("/metrics").status_code == 200


def test_a_partly_written_last_line_is_left_out(run_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "test_accuracy": 0.')
    c = client(run_dir)
    assert [r["round"] for r in c.get("/api/rounds").json()] == [1, 2, 3]
    families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    assert families["edgefleet_rounds"].samples[0].value == 3


def test_answers_change_with_the_files_bytes_not_their_times(run_dir: Path) -> None:
    # What the app made of the files is kept while their bytes are the same; a rewrite within
    # one clock tick, at the same size, is still a change.
    c = client(run_dir)
    path = run_dir / "fleet.json"
    before = c.get("/api/fleet").json()
    assert c.get("/metrics").text == c.get("/metrics").text
    stat = path.stat()
    text = path.read_text()
    assert '"battery": 7.0' in text
    path.write_text(text.replace('"battery": 7.0', '"battery": 8.0'))  # same length
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    after = c.get("/api/fleet").json()
    assert before["devices"][0]["battery"] == 7.0 and after["devices"][0]["battery"] == 8.0
    assert 'edgefleet_device_battery{device="0"} 8.0' in c.get("/metrics").text
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row(4)) + "\n")
    assert [r["round"] for r in c.get("/api/rounds").json()] == [1, 2, 3, 4]
    assert "edgefleet_rounds_total 4.0" in c.get("/metrics").text


def test_battery_history_from_batteries_jsonl(run_dir: Path) -> None:
    lines = [
        {"round": 1, "batteries": {"0": 8.0, "1": 4.0}},
        {"round": 2, "batteries": {"0": 6.0, "1": 2.0, "x": "full"}},  # a string: left out
        {"round": 2, "batteries": {"0": 7.0, "1": 3.0}},  # round 2 again (a resume): last wins
        {"round": 3, "batteries": {"1": 5.0}},
    ]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"round": 4, "batt'  # cut short
    (run_dir / "batteries.jsonl").write_text(text)
    c = client(run_dir)
    got = c.get("/api/batteries?device=1&device=0&device=nobody").json()
    assert got["rounds"] == [1, 2, 3]
    assert got["mean"] == [6.0, 5.0, 5.0] and got["min"] == [4.0, 3.0, 5.0]
    assert got["max"] == [8.0, 7.0, 5.0]
    assert got["devices"] == {"1": [4.0, 3.0, 5.0], "0": [8.0, 7.0, None], "nobody": [None] * 3}
    many = "&".join(f"device={i}" for i in range(20))
    assert len(c.get(f"/api/batteries?{many}").json()["devices"]) == 6  # bounded
    (run_dir / "batteries.jsonl").unlink()
    assert c.get("/api/batteries").json() == {
        "rounds": [], "mean": [], "min": [], "max": [], "devices": {}
    }  # fmt: skip


def test_the_fleet_writer_appends_each_rounds_batteries(tmp_path: Path) -> None:
    from edgefleet.dashboard import data
    from edgefleet.server import fleet as fleet_module

    assert data.BATTERIES == fleet_module.BATTERIES
    snap = fleet(3, [7.0, 3.25, 0.0])
    snap["devices"].append(device("no-battery", None))
    assert fleet_module.batteries_line(snap) == {
        "round": 3, "batteries": {"0": 7.0, "1": 3.25, "2": 0.0, HOSTILE_ID: 1.5}
    }  # fmt: skip
    snap["devices"] = [device("a", None), device("b", float("nan"))]
    assert fleet_module.batteries_line(snap) is None  # energy off: no line


def test_non_finite_numbers_in_the_run_files_read_as_null(run_dir: Path) -> None:
    # A diverged model's loss is Infinity in metrics.jsonl (Python's json writes it); the
    # strict JSON the page gets must not carry it, nor fail the whole endpoint over it.
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "test_loss": Infinity, "train_loss": NaN, "bytes_up": 1e999}\n')
    text = (run_dir / "fleet.json").read_text().replace('"battery": 7.0', '"battery": -Infinity')
    (run_dir / "fleet.json").write_text(text)
    c = client(run_dir)
    rounds = c.get("/api/rounds")
    assert rounds.status_code == 200
    last = rounds.json()[-1]
    assert (last["round"], last["test_loss"], last["train_loss"], last["bytes_up"]) == (
        4, None, None, None
    )  # fmt: skip
    fleet_reply = c.get("/api/fleet")
    assert fleet_reply.status_code == 200 and fleet_reply.json()["devices"][0]["battery"] is None
    assert c.get("/metrics").status_code == 200


def test_with_a_token_every_request_needs_it(run_dir: Path) -> None:
    c = client(run_dir, token="s3cret")
    for path in ("/", "/api/fleet", "/api/rounds", "/events", "/metrics", "/static/dashboard.js"):
        assert c.get(path).status_code == 401, path
    assert c.get("/api/fleet", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/fleet?token=wrong").status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    # The page's first load: ?token= sets a cookie and leaves the address bar.
    first = c.get("/?token=s3cret", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/"
    assert COOKIE in first.headers["set-cookie"] and "HttpOnly" in first.headers["set-cookie"]
    assert c.get("/api/fleet").status_code == 200  # the cookie


def test_no_token_answers_loopback_names_only(run_dir: Path) -> None:
    # Without a token only a loopback Host is answered (a DNS-rebinding page is refused).
    assert client(run_dir).get("/api/fleet").status_code == 200
    evil = TestClient(create_app(run_dir), base_url="http://attacker.example:8050")
    assert evil.get("/api/fleet").status_code == 403


def test_a_network_host_without_a_token_is_refused(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(DashboardError, match="--token TOKEN.*EDGEFLEET_DASHBOARD_TOKEN"):
        Dashboard(run_dir, host="0.0.0.0", port=0)
    assert main(["dashboard", str(run_dir), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--host 0.0.0.0 would show the fleet's device ids" in capsys.readouterr().err
    check_bind("0.0.0.0", "s3cret")
    check_bind("::1", None)
    check_bind("localhost", None)
    assert main(["dashboard", str(run_dir / "nope")]) == 2
    assert "no run folder" in capsys.readouterr().err


def _write_run(parent: Path, name: str, batteries: list[float], when: int) -> None:
    """A run folder whose folder and files were last changed at ``when`` (seconds)."""
    run = parent / name
    run.mkdir(exist_ok=True)
    (run / "fleet.json").write_text(json.dumps(fleet(1, batteries)))
    for path in (run / "fleet.json", run):
        os.utime(path, (when, when))


def test_latest_follows_the_run_written_to_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    c = TestClient(create_app(runs, latest=True, events_max_s=0.05), base_url=LOOPBACK)
    # No run yet: an empty page, not an error; nor is a folder without the run's files a run.
    (runs / "not-a-run").mkdir()
    (runs / "notes.txt").write_text("x")
    assert c.get("/api/summary").json() == {"run": "", "summary": {}}
    assert c.get("/api/fleet").json() == {}

    _write_run(runs, "b-old", [1.0, 2.0, 3.0], when=1_000)
    _write_run(runs, "a-new", [4.0, 5.0, 6.0], when=2_000)  # newer, though first by name
    assert c.get("/api/summary").json()["run"] == "a-new"
    assert [d["battery"] for d in c.get("/api/fleet").json()["devices"][:3]] == [4.0, 5.0, 6.0]
    first = c.get("/events").text

    # A round of b-old after a-new's last one (only its metrics.jsonl grew): b-old is newest.
    (runs / "b-old" / "metrics.jsonl").write_text(json.dumps(row(1)) + "\n")
    os.utime(runs / "b-old" / "metrics.jsonl", (3_000, 3_000))
    assert c.get("/api/summary").json()["run"] == "b-old"
    families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    batteries = {s.labels["device"]: s.value for s in families["edgefleet_device_battery"].samples}
    assert [batteries[d] for d in ("0", "1", "2")] == [1.0, 2.0, 3.0]
    assert c.get("/events").text != first  # the page refreshes onto the other run

    assert main(["dashboard", str(runs / "nope"), "--latest"]) == 2
    assert "or an output-dir with --latest" in capsys.readouterr().err


def test_hostile_strings_are_data_not_markup(run_dir: Path) -> None:
    c = client(run_dir)
    fleet_ids = [d["device"] for d in c.get("/api/fleet").json()["devices"]]
    assert HOSTILE_ID in fleet_ids  # served as JSON data: the page renders it as text
    script = c.get("/static/dashboard.js").text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "document.write" not in script
    text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ids = {s.labels["device"] for s in families["edgefleet_device_battery"].samples}
    assert HOSTILE_ID in ids  # escaped by prometheus_client, round-trips through the parser
    reasons = {s.labels["reason"] for s in families["edgefleet_replies_rejected"].samples}
    assert reasons == {reason_kind(HOSTILE_REASON)}
    assert "<script>" not in reason_kind(HOSTILE_REASON)  # the quoted value is dropped


def test_metrics_equal_the_files(run_dir: Path) -> None:
    data = json.loads((run_dir / "fleet.json").read_text())
    data["devices"][0]["battery"] = float("nan")  # as json.dumps writes it: NaN
    atomic_write_text(run_dir / "fleet.json", json.dumps(data))
    families = {
        f.name: f for f in text_string_to_metric_families(client(run_dir).get("/metrics").text)
    }

    def by_device(name: str) -> dict[str, float]:
        return {s.labels["device"]: s.value for s in families[name].samples}

    want = {
        d["device"]: d["battery"]
        for d in data["devices"]
        if isinstance(d["battery"], float) and math.isfinite(d["battery"])
    }
    assert by_device("edgefleet_device_battery") == want and "0" not in want
    assert by_device("edgefleet_device_online") == {"0": 1, "1": 1, "2": 1, HOSTILE_ID: 0}
    assert by_device("edgefleet_device_participations")["1"] == 2
    assert by_device("edgefleet_device_last_seen")["2"] == 3
    assert by_device("edgefleet_device_telemetry_cpu_temp") == {"1": 47.5}  # telemetry, generic
    assert "edgefleet_device_telemetry_platform" not in families  # a string: no gauge
    assert families["edgefleet_device_battery"].type == "gauge"

    def one(name: str) -> float:
        return families[name].samples[0].value

    assert families["edgefleet_rounds"].type == "counter"
    assert one("edgefleet_rounds") == 3
    assert one("edgefleet_replies_accepted") == 9
    assert one("edgefleet_replies_declined") == 1
    assert one("edgefleet_bytes_up") == 6000 and one("edgefleet_bytes_down") == 6000
    assert one("edgefleet_round") == 3 and one("edgefleet_session") == 1
    assert one("edgefleet_test_accuracy") == pytest.approx(0.53)
    assert one("edgefleet_task_vector_growth") == pytest.approx(0.02 / 3)
    assert one("edgefleet_stopping_tau") == 0.005
    assert one("edgefleet_devices") == 4 and one("edgefleet_devices_online") == 3


def async_row(version: int) -> dict[str, Any]:
    """A row of an asynchronous run (edgefleet.loop.asyncloop): one per version."""
    stale = {1: (0, 0.0, 0), 2: (0, 1.0, 3), 3: (1, 2.5, 7)}[version]
    return {
        **row(version),
        "version": version,
        "accepted": 3,
        "dropped": 0,
        "staleness_min": stale[0],
        "staleness_median": stale[1],
        "staleness_max": stale[2],
        "in_flight": 9 - version,
    }


def test_an_async_runs_staleness_and_in_flight_are_gauges(run_dir: Path) -> None:
    """The last version's staleness and devices in flight: gauges of an asynchronous run's
    folder, absent from a synchronous run's (no row has them)."""
    names = {f.name for f in text_string_to_metric_families(client(run_dir).get("/metrics").text)}
    assert not names & {"edgefleet_staleness_median", "edgefleet_staleness_max",
                        "edgefleet_in_flight"}  # fmt: skip
    rows = "".join(json.dumps(async_row(v)) + "\n" for v in (1, 2, 3))
    atomic_write_text(run_dir / "metrics.jsonl", rows)
    web = client(run_dir)
    families = {f.name: f for f in text_string_to_metric_families(web.get("/metrics").text)}

    def one(name: str) -> float:
        assert families[name].type == "gauge"
        return families[name].samples[0].value

    assert one("edgefleet_staleness_median") == 2.5
    assert one("edgefleet_staleness_max") == 7
    assert one("edgefleet_in_flight") == 6
    served = web.get("/api/rounds").json()
    assert [r["staleness_max"] for r in served] == [0, 3, 7]
    # JSON integers are unbounded: a row's 10^400 must not fail the whole scrape.
    last = json.dumps({**async_row(3), "round": 4, "version": 4, "in_flight": 0})
    huge = last.replace('"in_flight": 0', '"in_flight": 1' + "0" * 400) + "\n"
    atomic_write_text(run_dir / "metrics.jsonl", rows + huge)
    scrape = client(run_dir).get("/metrics")
    assert scrape.status_code == 200
    gauges = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    assert gauges["edgefleet_in_flight"].samples[0].value == 6  # the last usable row's


# `.ci/run` installs both binaries before the suite and sets this: there a missing one fails
# the test instead of skipping it, so CI cannot pass without having run them.
REQUIRE_TOOLS = os.environ.get("EDGEFLEET_REQUIRE_DASHBOARD_TOOLS") == "1"


def _need(binary: str) -> None:
    """Skip (fail where :data:`REQUIRE_TOOLS`) without a working ``binary``."""
    if not _works(binary):
        why = f"no working {binary} (apt-get install {binary})"
        if REQUIRE_TOOLS:
            pytest.fail(why)
        pytest.skip(why)


def _works(binary: str) -> bool:
    """``binary`` is installed and runs."""
    if shutil.which(binary) is None:
        return False
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


# --- a real browser --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(run_dir: Path) -> Iterator[Dashboard]:
    dashboard = Dashboard(run_dir, port=0, token="s3cret", events_max_s=30).start()
    try:
        yield dashboard
    finally:
        dashboard.stop()


# Upper bounds only (the checks return as soon as they hold), sized for a loaded CI machine
# where Chromium or Prometheus take many seconds to start.
def _until(what: str, check: Any, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class _DevTools:
    """The few DevTools-protocol calls the browser test needs, over one page's websocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=90))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return dict(reply["result"])

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


PAGE_STATE = """JSON.stringify({
  ready: document.body.dataset.ready || null,
  rows: document.body.dataset.rows || null,
  devices: [...document.querySelectorAll('#fleet tbody tr')].map(tr => [
    tr.dataset.device, tr.querySelector('td[data-col=battery]').textContent]),
  accuracy: [...document.querySelectorAll('#accuracy-last span')].map(s => [
    s.dataset.series, Number(s.dataset.round), Number(s.dataset.value)]),
  reasons: [...document.querySelectorAll('#reasons tbody .reason')].map(s => s.textContent),
  injected: document.querySelectorAll('#fleet img, #reasons img, script:not([src])').length,
  pwned: window.__pwned === undefined ? null : window.__pwned,
  asyncHidden: document.getElementById('async-figure').hidden,
  async: [...document.querySelectorAll('#async-last span')].map(s => [
    s.dataset.series, Number(s.dataset.round), Number(s.dataset.value)]),
  inFlight: (document.querySelector('[data-card="in flight"] b') || {}).textContent || null,
})"""


@contextlib.contextmanager
def _browser(tmp_path: Path, url: str) -> Iterator[_DevTools]:
    """A headless Chromium with one page open at ``url``, ended on leaving."""
    _need("chromium")
    pytest.importorskip("websockets", reason="the DevTools client needs websockets")
    from websockets.sync.client import connect

    profile = tmp_path / "chromium-profile"
    args = ["chromium", "--headless", "--disable-gpu", "--remote-debugging-port=0"]
    args += [f"--user-data-dir={profile}", "--window-size=1400,1700", "about:blank"]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root
    browser = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack = contextlib.ExitStack()
    try:
        port_file = profile / "DevToolsActivePort"
        # Chromium creates the file before it writes the port: an empty file is not ready yet.
        port = _until(
            "DevTools",
            lambda: port_file.exists() and next(iter(port_file.read_text().split()), None),
        )
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        ws = stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=2**26))
        tools = _DevTools(ws)
        tools.call("Page.navigate", url=url)
        yield tools
    finally:
        stack.close()
        browser.terminate()
        try:
            browser.wait(10)
        except subprocess.TimeoutExpired:
            browser.kill()


def test_the_page_in_a_real_browser_updates_without_a_reload(
    served: Dashboard, run_dir: Path, tmp_path: Path
) -> None:
    with _browser(tmp_path, f"{served.url}?token=s3cret") as tools:

        def state() -> dict[str, Any] | None:
            text = tools.js(PAGE_STATE)
            return json.loads(text) if isinstance(text, str) else None

        def rows() -> list[dict[str, Any]]:
            return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

        def check(seen: dict[str, Any], rnd: int) -> None:
            devices = json.loads((run_dir / "fleet.json").read_text())["devices"]
            # every device has its row (in the page's sort order), with its battery
            assert len(seen["devices"]) == len(devices)
            shown = {name: float(text) for name, text in seen["devices"]}
            assert shown == {d["device"]: d["battery"] for d in devices}
            last = rows()[-1]
            accuracy = {name: (r, v) for name, r, v in seen["accuracy"]}
            assert accuracy["test_accuracy"] == (rnd, last["test_accuracy"])
            assert accuracy["federated eval-accuracy"] == (rnd, last["federated"]["eval-accuracy"])
            assert seen["reasons"] == [HOSTILE_REASON]  # as text
            assert seen["injected"] == 0 and seen["pwned"] is None

        first = _until("the page", lambda: (s := state()) and s["ready"] and s)
        check(first, 3)
        # No asynchronous column in the rows: no staleness panel, no in-flight card.
        assert first["asyncHidden"] is True and first["inFlight"] is None
        # A new round lands while the page is open: the server's two writes. (It carries
        # the asynchronous loop's columns: the staleness panel appears with them.)
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({**row(4), "staleness_median": 1.5, "staleness_max": 4,
                                "in_flight": 7}) + "\n")  # fmt: skip
        atomic_write_text(run_dir / "fleet.json", json.dumps(fleet(4, [6.0, 2.5, 9.75])))
        second = _until("round 4", lambda: (s := state()) and s["rows"] == "4" and s)
        _until("fleet.json of round 4", lambda: (s := state()) and ["2", "9.75"] in s["devices"])
        check(state() or {}, 4)
        seen = state() or {}
        assert seen["asyncHidden"] is False and seen["inFlight"] == "7"
        assert seen["async"] == [["staleness_median", 4, 1.5], ["staleness_max", 4, 4],
                                 ["in_flight", 4, 7]]  # fmt: skip
        shot = tools.call("Page.captureScreenshot", format="png")["data"]
        (tmp_path / "dashboard.png").write_bytes(base64.b64decode(shot))
        assert second["ready"] and (tmp_path / "dashboard.png").stat().st_size > 10_000


TABLE_STATE = """JSON.stringify({
  ready: document.body.dataset.ready || null,
  ids: [...document.querySelectorAll('#fleet tbody tr')].map(tr => tr.dataset.device),
  pinned: [...document.querySelectorAll('#fleet tbody tr.pinned')].map(tr => tr.dataset.device),
  info: document.getElementById('page-info').textContent,
  battery: document.querySelectorAll('#chart-battery .u-series').length,
  source: document.getElementById('battery-source').textContent,
})"""


def test_a_large_fleet_is_shown_a_page_at_a_time(
    served: Dashboard, run_dir: Path, tmp_path: Path
) -> None:
    batteries = [float(i % 10) for i in range(249)]  # with the hostile device: 250
    atomic_write_text(run_dir / "fleet.json", json.dumps(fleet(3, batteries)))
    history = [{"round": r, "batteries": {"7": 9.0 - r, "8": 1.0}} for r in (1, 2, 3)]
    (run_dir / "batteries.jsonl").write_text("".join(json.dumps(x) + "\n" for x in history))
    with _browser(tmp_path, f"{served.url}?token=s3cret") as tools:

        def table() -> dict[str, Any]:
            text = tools.js(TABLE_STATE)  # None until the page's elements are there
            return dict(json.loads(text)) if isinstance(text, str) else {}

        def act(js: str, what: str, check: Any) -> dict[str, Any]:
            tools.js(js)
            return dict(_until(what, lambda: (t := table()) and check(t) and t))

        first = _until("the page", lambda: (t := table()) and t.get("ready") and t)
        # sorted by device id, naturally ("<img..." first): 0, 1, ..., 98 on the first page
        assert first["ids"] == [HOSTILE_ID] + [str(i) for i in range(99)]
        assert first["info"] == "rows 1–100 of 250"
        nxt = act("document.getElementById('page-next').click()", "page 2",
                  lambda t: t["info"] == "rows 101–200 of 250")  # fmt: skip
        assert nxt["ids"] == [str(i) for i in range(99, 199)]
        last = act("document.getElementById('page-next').click()", "page 3",
                   lambda t: t["info"] == "rows 201–250 of 250")  # fmt: skip
        assert last["ids"] == [str(i) for i in range(199, 249)]
        every = act(
            "{ const s = document.getElementById('page-size'); s.value = '0';"
            " s.dispatchEvent(new Event('change')); }",
            "all rows",
            lambda t: len(t["ids"]) == 250,
        )
        assert every["info"] == "rows 1–250 of 250"
        # A click on a row (one listener for the table) pins it to the battery chart.
        before = every["battery"]
        pinned = act(
            "document.querySelector('#fleet tbody tr[data-device=\"7\"] td').click()",
            "a pinned row",
            lambda t: t["pinned"] == ["7"] and t["battery"] == before + 1,
        )
        assert pinned["battery"] == before + 1
        assert pinned["source"] == "from batteries.jsonl (3 rounds)"
        # A click on a column header sorts by it: battery ascending puts the 0.0s first.
        ordered = act(
            "document.querySelector('#fleet thead th[data-col=battery]').click()",
            "sorted by battery",
            lambda t: t["ids"][0] == "0",
        )
        assert ordered["ids"][:3] == ["0", "10", "20"]


# --- a real Prometheus ----------------------------------------------------------------------


def test_a_real_prometheus_scrapes_each_devices_battery(
    served: Dashboard, run_dir: Path, tmp_path: Path
) -> None:
    _need("prometheus")
    target = urllib.parse.urlsplit(served.url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 2s\n  scrape_timeout: 2s\n"
        "scrape_configs:\n  - job_name: edgefleet\n"
        f"    authorization:\n      credentials: s3cret\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        query = urllib.parse.urlencode({"query": "edgefleet_device_battery"})

        def results() -> list[dict[str, Any]] | None:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=2
                ) as r:
                    found = json.load(r)["data"]["result"]
            except OSError:
                return None
            return found if len(found) == 4 else None

        found = _until("Prometheus' first scrape", results, timeout=120)
        got = {r["metric"]["device"]: float(r["value"][1]) for r in found}
        devices = json.loads((run_dir / "fleet.json").read_text())["devices"]
        assert got == {d["device"]: d["battery"] for d in devices}
        assert {r["metric"]["job"] for r in found} == {"edgefleet"}
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_run_dashboard_serves_the_folder_the_run_will_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgefleet import cli
    from edgefleet.simulation.runner import load_scenario

    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "fedavg.toml"
    overrides = {"output-dir": str(tmp_path / "runs")}
    fixed, dashboard = cli._start_dashboard(
        str(scenario), overrides, load_scenario(scenario, overrides)
    )
    try:
        name = fixed.run_config["run-name"]
        assert name.endswith("-fedavg")  # the dated default name, fixed before the run
        assert f"dashboard: {dashboard.url}" in capsys.readouterr().err
        run = tmp_path / "runs" / name
        with urllib.request.urlopen(dashboard.url + "api/summary", timeout=5) as r:
            assert json.load(r) == {"run": name, "summary": {}}
        run.mkdir(parents=True)
        (run / "fleet.json").write_text(json.dumps(fleet(1, [4.0, 5.0, 6.0])))
        with urllib.request.urlopen(dashboard.url + "api/fleet", timeout=5) as r:
            assert json.load(r)["round"] == 1
    finally:
        dashboard.stop()
    assert dashboard.thread is not None and not dashboard.thread.is_alive()
