"""The live fleet snapshot (fleet.json) from the device registry, and status values a
device may send: checked before they are kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.loop.roundloop import RoundLoop
from edgefleet.server.fleet import BATTERIES, FILENAME, FleetWriter
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from tests.fakes import FakeGrid, no_eval, rec
from tests.test_ehfedsag import KW, FakeDevice


class Reporting(FakeDevice):
    """Reports ``battery`` as its battery level."""

    def __init__(self, device: int, battery: object) -> None:
        super().__init__(device, 1.0)
        self.battery = battery

    def __call__(self, msg: Message) -> Message:
        reply = super().__call__(msg)
        if msg.metadata.message_type == MessageType.QUERY:
            status = dict(reply.content["status"])
            status["battery-level"] = self.battery  # type: ignore[assignment]
            reply.content = RecordDict({"status": MetricRecord(status)})
        return reply


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e9, [1.0, 2.0]])
def test_the_snapshot_holds_every_device_and_no_unchecked_value(tmp_path: Path, bad) -> None:
    def decline(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return FakeDevice(2, 0.0)(msg)
        from flwr.app import Error

        return Message(Error(11, "no battery"), reply_to=msg)

    grid = FakeGrid({1: Reporting(0, 3.5), 2: decline, 3: Reporting(1, bad)})  # type: ignore[dict-item]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=3, slots_per_round=4)
    writer = FleetWriter(tmp_path, stopping_tau=0.01)
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval,  # type: ignore[arg-type]
                     callbacks=[*strategy.round_callbacks(), writer])  # fmt: skip
    loop.run(rec(w=np.zeros(1)), 2)
    fleet = json.loads((tmp_path / FILENAME).read_text())  # strict JSON: no NaN got in
    assert (fleet["round"], fleet["stopping_tau"]) == (2, 0.01)
    assert sorted(fleet["selected"]) == ["0", "1", "2"]
    by_id = {d["device"]: d for d in fleet["devices"]}
    assert list(by_id) == ["0", "1", "2"]
    assert by_id["0"]["battery"] == 3.5 and by_id["0"]["participations"] == 2
    assert by_id["1"]["battery"] is None  # dropped, with a logged reason
    assert by_id["2"]["declines"] == 2 and by_id["2"]["participations"] == 0
    assert all(d["online"] and d["node"] in (1, 2, 3) for d in fleet["devices"])
    assert fleet["declined"] == ["2"]
    # The batteries' history: a line per round, only values that passed screening.
    history = [json.loads(x) for x in (tmp_path / BATTERIES).read_text().splitlines()]
    assert [h["round"] for h in history] == [1, 2]
    assert all(h["batteries"]["0"] == 3.5 and "1" not in h["batteries"] for h in history)
    assert history[-1]["batteries"] == {
        d: b["battery"] for d, b in by_id.items() if b["battery"] is not None
    }
