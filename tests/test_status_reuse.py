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

from edgefleet.client.mods import energy_mod, status_query
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.simulation.inprocess import ClientAppNode
from edgefleet.strategies.context import SelectionRow
from edgefleet.strategies.energy import EnergyAgeSelection
from edgefleet.strategies.loop import RoundLoop
from edgefleet.strategies.registry import EnergyState
from edgefleet.strategies.selection import SelectionError
from tests.fakes import FakeGrid, Rows, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


def _app(harvest_prob: float, drain: float = 0.0) -> ClientApp:
    """A device: battery of 4 units, a round costs 3 (2 training slots + 1 to send).
    ``drain`` > 0 makes the battery lose that much at each status answer too (a board whose
    battery also powers something else)."""
    app = ClientApp(mods=[energy_mod(capacity=4, harvest_prob=harvest_prob, train_slots=2)])

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
    # a train reply leaves the device's post-round energy in the registry
    states = [registry.energy(str(d)) for d in range(8)]
    assert any(s is not None and s.battery is not None and s.battery < 4 for s in states)


def test_without_reuse_every_candidate_is_asked_every_round() -> None:
    _, queries, _, _, _ = _run(max_age=0, rounds=4)
    assert queries == [8, 8, 8, 8]


def test_an_answer_older_than_the_max_age_or_infeasible_is_asked_again() -> None:
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=1, status_max_age=2)
    loop = RoundLoop(strategy, FakeGrid({}), evaluate_fn=no_eval)  # type: ignore[arg-type]
    registry = loop.registry
    registry.bind(5, "0")
    from edgefleet.strategies.context import in_round

    with in_round(loop.new_context(10)):
        registry.note_energy("0", EnergyState(8, True, 3.0))
        assert strategy._reusable("0", 10) is not None
        registry.note_energy("0", EnergyState(7, True, 3.0))
        assert strategy._reusable("0", 10) is None  # three rounds old
        registry.note_energy("0", EnergyState(9, False, 1.0))
        assert strategy._reusable("0", 10) is None  # may have harvested since
        registry.note_energy("0", None)  # a train message went out, no reply said the cost
        assert strategy._reusable("0", 10) is None


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
    with pytest.raises(SelectionError, match="status_max_age=-1 must be a whole number"):
        EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=1, status_max_age=-1)
    with pytest.raises(ConfigError, match="'selection.status-max-age' = 2 with selection.mode"):
        parse_run_config({"selection.status-max-age": 2})
    cfg = parse_run_config({"selection.mode": "energy-age", "selection.status-max-age": 2})
    assert cfg.energy.status_max_age == 2
