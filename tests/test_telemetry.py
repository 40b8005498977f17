"""Device telemetry: what the energy mod reports in a status answer, and how the server
screens it (type and bounds from one table) before the registry or fleet.json keep it."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from edgefleet.client.mods import (
    cpu_temperature,
    energy_mod,
    free_memory_mb,
    status_query,
)
from edgefleet.loop.registry import TELEMETRY_FIELDS, UNKNOWN_FIELDS, screen_telemetry
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.server.fleet import FILENAME, FleetWriter
from edgefleet.strategies.energy_selection import EnergyAgeSelection, selection_line
from edgefleet.wire import TELEMETRY_RECORD
from tests.fakes import FakeGrid, Rows, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


def _device_app(telemetry: dict[str, object] | None = None) -> ClientApp:
    """A ClientApp with the real energy mod (a harvest every slot, capacity 8) and
    EdgeFleet's status_query; ``telemetry`` replaces the mod's record (a hostile device)."""

    def hostile(msg: Message, context: Context, call_next):  # type: ignore[no-untyped-def]
        reply = call_next(msg, context)
        if telemetry is not None and msg.metadata.message_type == MessageType.QUERY:
            reply.content[TELEMETRY_RECORD] = ConfigRecord(telemetry)  # type: ignore[arg-type]
        return reply

    app = ClientApp(mods=[hostile, energy_mod(capacity=8, harvest_prob=1.0, train_slots=3)])
    app.query()(status_query)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy() + 1.0
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)

    return app


def _handler(app: ClientApp, device: int):  # type: ignore[no-untyped-def]
    context = Context(
        run_id=1, node_id=device, node_config={"device-id": device}, state=RecordDict(),
        run_config={},
    )  # fmt: skip
    return lambda msg: app(msg, context)


def _query(slot: int) -> Message:
    config = ConfigRecord({"slot": slot, "server-round": 1})
    return Message(RecordDict({"config": config}), dst_node_id=1, message_type=MessageType.QUERY)


def test_the_mod_reports_telemetry_in_the_status_answer() -> None:
    FakeGrid({})  # the task identity that building messages needs
    ask = _handler(_device_app(), 3)
    first = ask(_query(0))
    tele = dict(first.content[TELEMETRY_RECORD])
    assert tele["battery-capacity"] == 8.0 and tele["energy-spent"] == 0.0
    assert tele["harvested"] == 0.0  # starts full: nothing to harvest
    assert tele["arch"] and tele["flwr-version"].count(".") >= 1
    assert tele["load-1m"] >= 0.0 and tele["mem-free-mb"] > 0.0
    # Every key it sends is one the server keeps, and each passes the server's screening.
    assert set(tele) <= set(TELEMETRY_FIELDS)
    assert screen_telemetry(first.content[TELEMETRY_RECORD]).dropped == {}
    assert first.content["status"]["battery-level"] == 8.0  # the status record is unchanged


def test_harvest_is_counted_since_the_last_answer() -> None:
    FakeGrid({})
    ask = _handler(_device_app(), 3)
    ask(_query(0))
    config = ConfigRecord({"slot": 0, "server-round": 1})
    content = RecordDict({"config": config, "arrays": rec(w=np.zeros(1))})
    train_msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    assert not ask(train_msg).has_error()  # spends 4 of 8
    tele = ask(_query(3)).content[TELEMETRY_RECORD]
    assert (tele["harvested"], tele["energy-spent"]) == (3.0, 4.0)  # 3 slots, one unit each
    assert ask(_query(3)).content[TELEMETRY_RECORD]["harvested"] == 0.0  # nothing since


def test_board_readings_absent_are_not_sent(tmp_path: Path) -> None:
    assert cpu_temperature(str(tmp_path)) is None  # no thermal zone: no value
    zone = tmp_path / "thermal_zone1"
    zone.mkdir()
    (zone / "type").write_text("x86_pkg_temp\n")
    (zone / "temp").write_text("47500\n")
    (tmp_path / "thermal_zone0").mkdir()  # a zone without a reading is skipped
    assert cpu_temperature(str(tmp_path)) == 47.5
    assert free_memory_mb(str(tmp_path / "no-meminfo")) is None
    (tmp_path / "meminfo").write_text("MemTotal: 4096 kB\nMemAvailable: 2048 kB\n")
    assert free_memory_mb(str(tmp_path / "meminfo")) == 2.0


HOSTILE: dict[str, object] = {
    "battery-capacity": math.nan,
    "cpu-temp-c": 1e9,
    "load-1m": True,
    "mem-free-mb": [1.0, 2.0],
    "arch": "x" * 1_000_000,
    "accelerator": "<script>alert(1)</script>",
    "flwr-version": 1.42,
    "harvested": -1.0,
    "energy-spent": math.inf,
    "edgefleet-version": "0.1.0",  # the one good value
    "a-key-of-its-own": 1.0,
}


def test_screening_drops_every_hostile_value_with_its_reason() -> None:
    got = screen_telemetry(ConfigRecord(HOSTILE))  # type: ignore[arg-type]
    assert dict(got.values) == {"edgefleet-version": "0.1.0"}
    assert set(got.dropped) == set(HOSTILE) - {"edgefleet-version", "a-key-of-its-own"} | {
        UNKNOWN_FIELDS
    }
    assert "not in [0, 1e+06]" in got.dropped["battery-capacity"]
    assert "1e9" not in got.dropped["arch"] and len(got.dropped["arch"]) < 100  # not echoed
    assert "not a number" in got.dropped["load-1m"]  # a bool is not a load
    assert "a-key-of-its-own" not in got.dropped[UNKNOWN_FIELDS]
    assert screen_telemetry(None).values == {}
    assert screen_telemetry(rec(w=np.zeros(1))).dropped  # not a record of values


def test_hostile_telemetry_through_the_status_path_never_reaches_fleet_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid = FakeGrid({1: _handler(_device_app(), 0), 2: _handler(_device_app(HOSTILE), 1)})
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4)
    rows = Rows()
    callbacks = [*strategy.round_callbacks(), FleetWriter(tmp_path), rows]
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=callbacks)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="flwr"):
        loop.run(rec(w=np.zeros(1)), 3)
    text = (tmp_path / FILENAME).read_text()
    fleet = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in fleet.json"))
    good, bad = (d for d in fleet["devices"])
    assert good["telemetry"]["battery-capacity"] == 8.0 and not good["telemetry_dropped"]
    assert bad["telemetry"] == {"edgefleet-version": "0.1.0"}  # no hostile value kept
    assert "not in" in bad["telemetry_dropped"]["cpu-temp-c"]
    assert "<script>" not in text and "xxxx" not in text and len(text) < 20_000
    assert bad["battery"] == 8.0 and bad["participations"] == 3  # the rest of it still counts
    # Counted in every round's row, logged once per device and field.
    columns = [r.context.columns().get("telemetry_dropped") for r in rows.results]
    assert all(c is not None and c["cpu-temp-c"] == 1 for c in columns)
    dropped_lines = [r for r in caplog.records if "telemetry dropped" in r.getMessage()]
    assert len(dropped_lines) == 1 and "Device 1" in dropped_lines[0].getMessage()
    assert any("2 of 2 nodes selected: 0 (battery" in r.getMessage() for r in caplog.records)


def test_the_selection_line_names_devices_caps_the_list_and_never_says_zero_asked() -> None:
    line = selection_line(["3", "7"], 4, {"3": 0.812, "7": 0.55}, 4)
    assert line == "2 of 4 nodes selected: 3 (battery 0.81), 7 (0.55); 4 status queries"
    reused = selection_line(["3"], 4, {"3": None}, 0)
    assert reused == "1 of 4 nodes selected: 3; statuses reused from this round's presence query"
    many = selection_line([str(i) for i in range(25)], 30, {}, 30)
    assert many.endswith("9, and 15 more; 30 status queries")
    assert selection_line([], 0, {}, 0) == "0 of 0 nodes selected"


def test_every_telemetry_value_the_mod_sends_reaches_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names on /metrics are those of what the devices really send (the energy mod's
    record, hyphens and all), not a list typed here: each numeric value the mod sent reaches
    ``edgefleet_device_telemetry_<name with underscores>`` with its value."""
    from prometheus_client.parser import text_string_to_metric_families

    from edgefleet.client import mods
    from edgefleet.dashboard.metrics import render
    from edgefleet.server.results import MetricsWriter

    # Board readings this machine may lack (no thermal zone in a container), so that the mod
    # sends every field of its table; the link rate is what an operator declares.
    monkeypatch.setattr(mods, "cpu_temperature", lambda *_: 47.5)
    monkeypatch.setattr(mods, "free_memory_mb", lambda *_: 2048.0)
    app = _device_app()
    context = Context(
        run_id=1, node_id=1, node_config={"device-id": 0, "link-kbps": 512}, state=RecordDict(),
        run_config={},
    )  # fmt: skip
    sent: list[dict[str, object]] = []

    def node(msg: Message) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == MessageType.QUERY:
            sent.append(dict(reply.content[TELEMETRY_RECORD]))
        return reply

    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=4)
    callbacks = [*strategy.round_callbacks(), FleetWriter(tmp_path), MetricsWriter(tmp_path)]
    loop = RoundLoop(strategy, FakeGrid({1: node}), evaluate_fn=no_eval, callbacks=callbacks)  # type: ignore[arg-type]
    loop.run(rec(w=np.zeros(1)), 1)

    numeric = {k: v for k, v in sent[-1].items() if isinstance(v, float)}
    assert any("-" in k for k in numeric)  # the case the name check used to drop
    assert set(numeric) == {k for k, f in TELEMETRY_FIELDS.items() if f.kind is float}
    families = {f.name: f for f in text_string_to_metric_families(render(tmp_path).decode())}
    for key, value in numeric.items():
        name = "edgefleet_device_telemetry_" + key.replace("-", "_")
        assert name in families, (key, sorted(families))
        assert {s.labels["device"]: s.value for s in families[name].samples} == {"0": value}


def test_a_field_name_prometheus_cannot_hold_is_refused_not_guessed() -> None:
    from edgefleet.dashboard.metrics import _numeric_fields, metric_name

    assert metric_name("cpu-temp-c") == "cpu_temp_c" and metric_name("Load-1M") == "load_1m"
    for bad in ("a.b", "temp c", "températ", "1st", "x" * 65, "", "a{b}", "a\nb"):
        assert metric_name(bad) is None, bad
    device = {"device": "3", "battery": 1.0,
              "telemetry": {"load-1m": 0.5, "load_1m": 9.0, "a.b": 1.0, "arch": "arm"}}  # fmt: skip
    # load-1m and load_1m map to one name: the first is kept, never two samples of one name
    assert dict(_numeric_fields(device)) == {"battery": 1.0, "telemetry_load_1m": 0.5}
