"""Energy-age selection reusing a device's last "feasible" answer (``selection.status-max-age``).

The devices here are real: a ClientApp with EdgeFleet's energy mod (a seeded harvesting
battery per device) and its status query, driven through the in-process engine's node
wrapper, so the train replies carry what the mod adds after paying for a round.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from edgefleet.algorithms.selection import SelectionError
from edgefleet.client.mods import energy_mod, status_query
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.context import SelectionRow, in_round
from edgefleet.loop.registry import DeviceStatus, EnergyState
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.simulation.inprocess import ClientAppNode
from edgefleet.strategies.energy_selection import STATUS_REFRESH_ROUNDS, EnergyAgeSelection
from tests.fakes import FakeGrid, Rows, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


def _app(harvest_prob: float, capacity: float = 4) -> ClientApp:
    """A device: battery of ``capacity`` units, a round costs 3 (2 training slots + 1 to
    send)."""
    app = ClientApp(mods=[energy_mod(capacity=capacity, harvest_prob=harvest_prob, train_slots=2)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content.array_records["arrays"]
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    app.query()(status_query)
    return app


def _run(max_age: int, rounds: int = 14, devices: int = 8, prob: float = 0.2):
    app = _app(prob)
    nodes = {
        100 + i: ClientAppNode(app, Context(1, 100 + i, {"device-id": i}, RecordDict(), {}), 1)
        for i in range(devices)
    }
    grid = FakeGrid(nodes)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(
        FedAvg(**KW), max_devices=3, slots_per_round=2, seed=3, status_max_age=max_age
    )
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )
    loop.run(rec(w=np.zeros(1)), rounds)
    selected = [r.context.section(SelectionRow).selected for r in rows.results]
    queries = [r.context.section(SelectionRow).status_queries for r in rows.results]
    reused = [r.context.section(SelectionRow).status_reused or 0 for r in rows.results]
    declined = [r.declined for r in rows.results]
    return selected, queries, reused, declined, loop.registry


def test_reusing_feasible_answers_selects_what_asking_selects_with_fewer_queries() -> None:
    # A harvesting battery only gains energy while idle, so a device that said "feasible"
    # (or whose train reply said so after paying) still is: the selection must be the one
    # asking every round gives, round by round, with fewer status messages.
    asked, asked_queries, none_reused, asked_declined, _ = _run(max_age=0)
    reused, reused_queries, reused_counts, reused_declined, registry = _run(max_age=3)
    assert reused == asked
    assert sum(len(s) for s in asked) >= 20  # energy was scarce, yet rounds were full enough
    assert any(len(s) < 3 for s in asked)  # and some round lacked a feasible device
    assert not any(none_reused)
    assert sum(reused_counts) > 0
    assert sum(reused_queries) < sum(asked_queries)
    assert not any(asked_declined) and not any(reused_declined)  # nobody selected without energy
    # a train reply leaves the device's post-round energy in the registry (a record of its
    # own: the round's averaged metrics do not get it)
    states = [registry.energy(str(d)) for d in range(8)]
    assert any(s is not None and s.battery is not None and s.battery < 4 for s in states)
    assert all(s is None or s.round >= 1 for s in states)


def test_a_status_answer_whose_feasible_is_not_0_or_1_is_malformed() -> None:
    # NaN, 0.5 or 7 once counted as feasible (bool(x)); such an answer is now ignored.
    from edgefleet.loop.status import _parse_status

    for bad in (float("nan"), 0.5, 7):
        status = MetricRecord({"device-id": 1, "feasible": bad, "present": 1})
        assert _parse_status(3, status) is None
    ok = _parse_status(3, MetricRecord({"device-id": 1, "feasible": 0, "present": 1}))
    assert ok is not None and ok.feasible is False


def test_without_reuse_every_candidate_is_asked_every_round() -> None:
    _, queries, _, _, _ = _run(max_age=0, rounds=4)
    assert queries == [8, 8, 8, 8]


def test_an_answer_older_than_the_max_age_or_infeasible_is_asked_again() -> None:
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=1, status_max_age=2)
    loop = RoundLoop(strategy, FakeGrid({}), evaluate_fn=no_eval)  # type: ignore[arg-type]
    registry = loop.registry
    registry.bind(5, "0")
    registry.note_status(6, 5, DeviceStatus("0", True, True, battery=4.0))

    with in_round(loop.new_context(10)):
        registry.note_energy("0", EnergyState(8, True, 3.0))
        assert strategy._reusable("0", 10) is not None
        registry.note_energy("0", EnergyState(7, True, 3.0))
        assert strategy._reusable("0", 10) is None  # three rounds old
        registry.note_energy("0", EnergyState(9, False, 1.0))
        assert strategy._reusable("0", 10) is None  # may have harvested since
        registry.note_energy("0", None)  # a train message went out, no reply said the cost
        assert strategy._reusable("0", 10) is None
    # a fresh energy answer, but the last status answer (telemetry, presence) is too old
    with in_round(loop.new_context(6 + STATUS_REFRESH_ROUNDS)):
        registry.note_energy("0", EnergyState(5 + STATUS_REFRESH_ROUNDS, True, 3.0))
        assert strategy._reusable("0", 6 + STATUS_REFRESH_ROUNDS) is None
    # the fleet view shows the newer of the two answers
    (view,) = registry.snapshot({5})
    assert (view["battery"], view["feasible"], view["status_round"]) == (3.0, True, 6)


def test_a_device_gone_since_its_reply_is_selected_once_more_then_asked() -> None:
    # What asking also checks is that the device is there. Every device trains in round 1
    # (M = 3, batteries that cover two rounds), then one node dies but is still listed:
    # reuse selects it once more (its round misses it), its train message forgot its
    # answer, and from round 3 it is asked and left out.
    app = _app(1.0, capacity=10)
    nodes = {
        n: ClientAppNode(app, Context(1, n, {"device-id": n - 1}, RecordDict(), {}), 1)
        for n in (1, 2, 3)
    }
    grid = FakeGrid(nodes)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(
        FedAvg(**KW), max_devices=3, slots_per_round=8, seed=0, status_max_age=1
    )
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )
    w = loop.run(rec(w=np.zeros(1)), 1).arrays
    assert sorted(rows.last(SelectionRow).selected) == ["0", "1", "2"]
    grid.handlers[2] = lambda msg: None  # device 1's node: listed, never answers
    w = loop.run(w, 2, first_round=2).arrays
    second = rows.last(SelectionRow)
    assert sorted(second.selected) == ["0", "1", "2"] and second.status_queries == 0
    assert sorted(rows.results[-1].participants) == ["0", "2"]
    assert loop.registry.energy("1") is None
    for rnd in (3, 4):
        w = loop.run(w, rnd, first_round=rnd).arrays
        assert sorted(rows.last(SelectionRow).selected) == ["0", "2"]
        assert sorted(rows.results[-1].participants) == ["0", "2"]


def test_a_train_message_without_an_energy_reply_forgets_the_answer() -> None:
    # A device that trained (and may have spent) but whose reply says nothing of its battery
    # (a ClientApp without the energy mod, or no reply at all) must be asked again.
    app = _app(0.35)
    silent = ClientApp()

    @silent.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content.array_records["arrays"]
        record = MetricRecord({"num-examples": 10, "device-id": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": record}), reply_to=msg)

    @silent.query()
    def query(msg: Message, context: Context) -> Message:
        status = MetricRecord({"present": 1, "feasible": 1, "device-id": 1})
        return Message(RecordDict({"status": status}), reply_to=msg)

    nodes = {
        1: ClientAppNode(app, Context(1, 1, {"device-id": 0}, RecordDict(), {}), 1),
        2: ClientAppNode(silent, Context(1, 2, {}, RecordDict(), {}), 1),
    }
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4, status_max_age=5)
    rows = Rows()
    loop = RoundLoop(
        strategy, FakeGrid(nodes), evaluate_fn=no_eval,  # type: ignore[arg-type]
        callbacks=[*strategy.round_callbacks(), rows],
    )  # fmt: skip
    loop.run(rec(w=np.zeros(1)), 2)
    assert loop.registry.energy("1") is None
    second = rows.results[1].context.section(SelectionRow)
    assert second.status_queries >= 1  # device 1 was asked again


def test_bad_max_age_is_refused_before_any_work() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(SelectionError, match=f"status_max_age={bad!r} must be a whole"):
            EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=1, status_max_age=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'selection.status-max-age' = 2 with selection.mode"):
        parse_run_config({"selection.status-max-age": 2})
    cfg = parse_run_config({"selection.mode": "energy-age", "selection.status-max-age": 2})
    assert cfg.energy.status_max_age == 2
