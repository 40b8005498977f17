"""The round loop's status phase: one status query a round for every wrapper, on one fleet
clock (edgefleet/loop/status.py).

The devices are real ClientApps with EdgeFleet's energy mod and status query, driven through
the in-process engine's node wrapper; a recording wrapper around each counts what reached it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from edgefleet.client.mods import energy_mod, status_query
from edgefleet.loop.context import SelectionRow, SessionRow
from edgefleet.loop.status import REASON_CHARS, FleetConflict
from edgefleet.simulation.inprocess import ClientAppNode
from edgefleet.strategies import (
    EnergyAgeSelection,
    FedSAG,
    RoundLoop,
    SessionStore,
    SessionTracker,
    WarmStartInitializer,
)
from tests.fakes import FakeGrid, Rows, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


def _app() -> ClientApp:
    """A device whose battery always covers a round (2 slots + 1 to send, 1 unit a slot)."""
    app = ClientApp(mods=[energy_mod(capacity=6, harvest_prob=1.0, train_slots=2)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content.array_records["arrays"]
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    app.query()(status_query)
    return app


class Recorded:
    """A node that keeps (message type, slot) of every message it gets."""

    def __init__(self, node: ClientAppNode) -> None:
        self.node, self.got = node, []  # type: ignore[var-annotated]

    def __call__(self, msg: Message) -> Message:
        config = msg.content.config_records.get("config") if msg.has_content() else None
        self.got.append((msg.metadata.message_type, None if config is None else config.get("slot")))
        return self.node(msg)

    def queries(self) -> int:
        return sum(kind == "query" for kind, _ in self.got)


def _fleet(devices: int = 5) -> dict[int, Recorded]:
    app = _app()
    return {
        10 + i: Recorded(
            ClientAppNode(app, Context(1, 10 + i, {"device-id": i}, RecordDict(), {}), 1)
        )
        for i in range(devices)
    }


def _sessions(inner, tmp_path: Path, **kw) -> WarmStartInitializer:  # type: ignore[no-untyped-def]
    return WarmStartInitializer(
        inner,
        store=SessionStore(tmp_path / "store", 3),
        initial=rec(w=np.zeros(1)),
        tracker=SessionTracker(0.2, 0),
        mode="previous",
        **kw,
    )


def _run(strategy, nodes, rounds: int) -> Rows:  # type: ignore[no-untyped-def]
    rows = Rows()
    loop = RoundLoop(
        strategy,
        FakeGrid(nodes),
        evaluate_fn=no_eval,
        callbacks=[*strategy.round_callbacks(), rows],
    )
    loop.run(rec(w=np.zeros(1)), rounds)
    return rows


def test_sessions_and_selection_ask_each_node_once_a_round(tmp_path: Path) -> None:
    nodes = _fleet()
    strategy = _sessions(
        EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4), tmp_path
    )
    rows = _run(strategy, nodes, 3)
    assert [n.queries() for n in nodes.values()] == [3] * len(nodes)  # once a round, each
    for res in rows.results:
        assert res.context.section(SessionRow).presence_queries == len(nodes)
        assert res.context.section(SelectionRow).status_queries == 0  # read, not asked again
        assert len(res.participants) == 2


def test_one_clock_every_message_of_a_round_carries_the_fleets_slot(tmp_path: Path) -> None:
    """The sessions wrapper declares no clock: it follows the selection's 4 slots a round.
    (It used to keep 1 of its own: its presence query ran behind the train messages, and
    the energy mod refused it.)"""
    nodes = _fleet()
    strategy = _sessions(
        EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4), tmp_path
    )
    rows = _run(strategy, nodes, 4)
    for node in nodes.values():
        slots = [slot for _, slot in node.got]
        assert slots == sorted(slots) and set(slots) <= {0, 4, 8, 12}, node.got
    assert [len(r.participants) for r in rows.results] == [2, 2, 2, 2]
    assert {r.session for r in rows.results} == {1}  # nobody departed


def test_status_answers_are_reused_by_age() -> None:
    """``status_max_age``: a device whose last answer (its train reply's energy record) said
    feasible is not asked again within that many rounds."""
    nodes = _fleet(4)
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=4, slots_per_round=3, status_max_age=2)
    rows = _run(strategy, nodes, 3)
    queries = [r.context.section(SelectionRow).status_queries for r in rows.results]
    reused = [r.context.section(SelectionRow).status_reused for r in rows.results]
    assert queries == [4, 0, 0] and reused == [None, 4, 4]
    assert [n.queries() for n in nodes.values()] == [1] * 4


def test_two_clocks_are_refused_before_round_1_naming_both(tmp_path: Path) -> None:
    nodes = _fleet()
    inner = EnergyAgeSelection(FedSAG(**KW), max_devices=2, slots_per_round=4)
    strategy = _sessions(inner, tmp_path, slots_per_round=1)
    with pytest.raises(FleetConflict, match=r"slots_per_round=1.*slots_per_round=4"):
        strategy.start(FakeGrid(nodes), rec(w=np.zeros(1)), num_rounds=2)  # type: ignore[arg-type]
    assert all(not n.got for n in nodes.values())  # nothing was sent
    # the same value twice is one clock
    same = _sessions(
        EnergyAgeSelection(FedSAG(**KW), max_devices=2, slots_per_round=4),
        tmp_path,
        slots_per_round=4,
    )
    assert RoundLoop(same, FakeGrid(nodes)).fleet.slots_per_round == 4  # type: ignore[arg-type]


def test_the_participant_cap_is_the_fleets_not_a_side_channel(tmp_path: Path) -> None:
    inner = EnergyAgeSelection(FedSAG(**KW), max_devices=3, slots_per_round=4)
    loop = RoundLoop(_sessions(inner, tmp_path), FakeGrid(_fleet()))  # type: ignore[arg-type]
    assert loop.fleet.participant_cap == 3
    assert loop.new_context(1).participant_cap == 3  # before any wrapper ran


def test_an_error_answer_is_logged_with_its_reason_and_is_no_departure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nodes = _fleet(4)
    broken = nodes[12]
    calls = {"n": 0}

    def flaky(msg: Message) -> Message:
        # round 2's status query: an error reply (a device-side failure, a long reason)
        if msg.metadata.message_type == "query":
            calls["n"] += 1
            if calls["n"] == 2:
                return Message(Error(13, "clock " + "x" * 5000), reply_to=msg)
        return broken(msg)

    nodes[12] = flaky  # type: ignore[assignment]
    strategy = _sessions(
        EnergyAgeSelection(FedAvg(**KW), max_devices=4, slots_per_round=4), tmp_path
    )
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.WARNING, logger="flwr"):
        rows = _run(strategy, nodes, 3)
    said = [r.getMessage() for r in caplog.records if "answered the status query" in r.getMessage()]
    assert len(said) == 1 and "code 13: clock xxx" in said[0]
    assert len(said[0]) < REASON_CHARS + 200  # bounded: the device's 5,000 characters are not
    assert [r.session for r in rows.results] == [1, 1, 1]  # the device did not depart
    assert rows.results[1].context.section(SessionRow).left is None
    assert "2" not in rows.results[1].participants and len(rows.results[2].participants) == 4
