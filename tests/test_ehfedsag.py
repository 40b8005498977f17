"""EH-FedSAG wired together: FedSAG aggregation, energy-age selection, the client's battery."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg

from edgefleet.client.app import app
from edgefleet.config import parse_run_config
from edgefleet.loop.context import ScreeningRow, SelectionRow
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.loop.status import Declaration, StatusPhase, StatusQuery
from edgefleet.server.app import build_strategy
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.equalweight import EqualWeightFedAvg
from edgefleet.strategies.fedsag import FedSAG
from tests.fakes import FakeGrid, Rows, by_hand, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


class FakeDevice:
    """Answers status queries from a fixed feasibility plan and trains by adding a fixed
    delta; counts what it was asked."""

    def __init__(self, device: int, delta: float, feasible: list[bool] | bool = True) -> None:
        self.device, self.delta, self.feasible = device, delta, feasible
        self.queries = 0
        self.trains = 0

    def __call__(self, msg: Message) -> Message:
        rnd = int(msg.content["config"]["server-round"])
        if msg.metadata.message_type == MessageType.QUERY:
            self.queries += 1
            ok = self.feasible if isinstance(self.feasible, bool) else self.feasible[rnd - 1]
            status = MetricRecord(
                {"device-id": self.device, "battery-level": 5.0, "feasible": int(ok), "present": 1}
            )
            return Message(RecordDict({"status": status}), reply_to=msg)
        self.trains += 1
        w = msg.content["arrays"]["w"].numpy() + self.delta
        metrics = MetricRecord({"num-examples": 1, "device-id": self.device, "energy-spent": 4.0})
        return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)


def _two_rounds_by_hand(strategy: FedSAG) -> ArrayRecord:
    """Three devices (deltas +1, +2, +4), zero-initialised memories; round 1: devices
    0 and 1 train, round 2: devices 1 and 2. The model after round 2."""
    devices = {1: FakeDevice(0, 1.0), 2: FakeDevice(1, 2.0), 3: FakeDevice(2, 4.0)}
    plan = {1: [1, 2], 2: [2, 3]}

    class Planned(FakeGrid):
        rnd = 0

        def get_node_ids(self) -> list[int]:
            return plan[self.rnd]

    grid = Planned(devices)  # type: ignore[arg-type]
    strategy.register_devices(["0", "1", "2"])
    w = rec(w=np.zeros(1))
    for rnd in (1, 2):
        grid.rnd = rnd
        with by_hand(rnd):
            msgs = list(strategy.configure_train(rnd, w, ConfigRecord(), grid))  # type: ignore[arg-type]
            w, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))  # type: ignore[assignment]
    return w


def test_fedsag_two_rounds_by_hand() -> None:
    strategy = FedSAG(**KW)
    w = _two_rounds_by_hand(strategy)
    # round 1: mean(m) = 0, corrections (1 - 0, 2 - 0) -> v = 1.5; memories (1, 2, 0)
    # round 2: mean(m) = 1, corrections (2 - 2, 4 - 0) -> v = 1 + 2 = 3; total 4.5
    np.testing.assert_allclose(w["w"].numpy(), [4.5])  # type: ignore[index]
    assert strategy.memory is not None
    np.testing.assert_allclose(strategy.memory.mean(), [(1 + 2 + 4) / 3])


def test_fedsag_sag_estimator_two_rounds_by_hand() -> None:
    """``estimator="sag"``: the direction is the memory mean after the participants'
    memories are replaced."""
    w = _two_rounds_by_hand(FedSAG(estimator="sag", **KW))
    # round 1: memories (1, 2, 0) -> v = 1; round 2: memories (1, 2, 4) -> v = 7/3
    np.testing.assert_allclose(w["w"].numpy(), [1 + 7 / 3], rtol=1e-6)  # type: ignore[index]
    with pytest.raises(ValueError, match="valid: saga, sag"):
        FedSAG(estimator="sga", **KW)


def test_fedsag_stored_memory_mean_two_rounds_by_hand() -> None:
    """``mean_over="stored"`` (the seed's wording): the memory mean runs over the devices
    that have uploaded, not over all K registered ones."""
    strategy = FedSAG(mean_over="stored", **KW)
    w = _two_rounds_by_hand(strategy)
    # round 1: nothing stored, v = (1 + 2) / 2 = 1.5; memories of devices 0, 1: (1, 2)
    # round 2: stored mean (1 + 2) / 2 = 1.5, corrections (2 - 2, 4 - 0) / 2 = 2 -> v = 3.5
    np.testing.assert_allclose(w["w"].numpy(), [5.0])  # type: ignore[index]
    assert strategy.memory is not None
    np.testing.assert_allclose(strategy.memory.mean(), [(1 + 2 + 4) / 3])
    with pytest.raises(ValueError, match="valid: stored, fleet"):
        FedSAG(mean_over="all", **KW)


def test_fedsag_correction_floor_two_rounds_by_hand() -> None:
    """``correction_floor=4``: each correction enters at 1 / max(|S|, 4), here 1/4 (two
    participants a round) instead of 1/2. A fourth device is registered and never trains."""
    strategy = FedSAG(correction_floor=4.0, **KW)
    strategy.register_devices(["9"])
    w = _two_rounds_by_hand(strategy)
    # round 1: mean(m) = 0, corrections (1 + 2) / 4 -> v = 0.75; memories (1, 2, 0, 0)
    # round 2: mean(m) = 3/4, corrections (2 - 2 + 4 - 0) / 4 = 1 -> v = 1.75; total 2.5
    np.testing.assert_allclose(w["w"].numpy(), [2.5])  # type: ignore[index]
    # a floor at or below |S| is the seed's plain 1/|S|
    np.testing.assert_allclose(
        _two_rounds_by_hand(FedSAG(correction_floor=2.0, **KW))["w"].numpy(),  # type: ignore[index]
        [4.5],
    )
    # a floor above K = 3 stops at 1/K, where SAGA's direction is SAG's (1 + 7/3)
    np.testing.assert_allclose(
        _two_rounds_by_hand(FedSAG(correction_floor=10.0, **KW))["w"].numpy(),  # type: ignore[index]
        [1 + 7 / 3],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="correction_floor"):
        FedSAG(correction_floor=-1.0, **KW)


def test_run_config_and_library_share_one_correction_default() -> None:
    def inner(overrides: dict) -> FedSAG:
        strategy = build_strategy(parse_run_config({"strategy": "fedsag", **overrides}))
        while hasattr(strategy, "inner"):
            strategy = strategy.inner
        assert isinstance(strategy, FedSAG)
        return strategy

    energy = {"selection.mode": "energy-age", "selection.max-devices": 7}
    # The app passes the key on; M comes from the selection around FedSAG, in any app.
    assert inner(energy).correction == FedSAG().correction == "channels"
    assert inner(energy).correction_floor == 0.0
    assert inner({**energy, "saga.correction": "participants"}).correction == "participants"
    seed_form = inner({**energy, "saga.correction": "participants", "saga.memory-mean": "stored"})
    assert seed_form.mean_over == "stored" and seed_form.estimator == "saga"
    top = build_strategy(parse_run_config({**energy, "selection.order": "random"}))
    assert isinstance(top, EnergyAgeSelection) and top.order == "random"
    with pytest.raises(ValueError, match="valid: channels, participants"):
        FedSAG(correction="floor")


def test_the_selection_cap_is_the_correction_floor() -> None:
    """Under a selection that caps a round at M devices, FedSAG's default weighs each
    correction 1/max(|S|, M): four devices answer, two can afford the round (deltas +1, +2,
    zero memories), M = 4, so v = (1 + 2) / 4 against the seed's (1 + 2) / 2."""
    kept = {}
    for name, correction in (("capped", "channels"), ("seed", "participants")):
        devices = {n: FakeDevice(n - 1, float(n), feasible=n <= 2) for n in (1, 2, 3, 4)}
        strategy = EnergyAgeSelection(
            FedSAG(correction=correction, **KW), max_devices=4, slots_per_round=4
        )
        loop = RoundLoop(strategy, FakeGrid(devices), evaluate_fn=no_eval,  # type: ignore[arg-type]
                         callbacks=strategy.round_callbacks())  # fmt: skip
        kept[name] = float(loop.run(rec(w=np.zeros(1)), 1).arrays["w"].numpy()[0])
    assert kept == {"capped": pytest.approx(0.75), "seed": pytest.approx(1.5)}


class _Replies(FakeDevice):
    """Replies with a fixed local model, whatever the global one."""

    def __init__(self, device: int, local: float) -> None:
        super().__init__(device, 0.0)
        self.local = local

    def __call__(self, msg: Message) -> Message:
        reply = super().__call__(msg)
        if msg.metadata.message_type == MessageType.TRAIN:
            reply.content["arrays"] = rec(w=np.array([self.local]))
        return reply


def test_fedsag_never_makes_a_finite_model_non_finite() -> None:
    # Two finite float32 replies whose step (server lr 2: theta + 2 x max / 2 = 1.5 max)
    # overflows float32: the round is skipped, the memory left as it was, the run goes on.
    big = float(np.finfo(np.float32).max)
    strategy = FedSAG(server_lr=2.0, **KW)
    loop = RoundLoop(
        strategy,
        FakeGrid({1: _Replies(0, big), 2: _Replies(1, big)}),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
    )
    start = rec(w=np.array([big / 2]))
    out = loop.run(start, 1)
    np.testing.assert_array_equal(out.arrays["w"].numpy(), [np.float32(big / 2)])
    # nothing was stored: the memory has no row yet
    assert strategy.memory is not None and strategy.memory.nbytes == 8
    # the same replies with server lr 1: theta + max / 2 = max, a finite step
    out = RoundLoop(
        FedSAG(**KW),
        FakeGrid({1: _Replies(0, big), 2: _Replies(1, big)}),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
    ).run(rec(w=np.array([big / 2])), 1)
    np.testing.assert_allclose(out.arrays["w"].numpy(), [big], rtol=1e-6)


def test_fedsag_drops_a_delta_beyond_the_memory_range_and_keeps_the_rest() -> None:
    # -max to +max: each model is finite float32, the difference (2 x max) is not.
    big = float(np.finfo(np.float32).max)
    strategy = FedSAG(**KW)
    out = RoundLoop(
        strategy,
        FakeGrid({1: _Replies(0, big), 2: _Replies(1, -big + 2.0**104)}),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
    ).run(rec(w=np.array([-big])), 1)
    # device 0's delta (2 x max) is dropped; device 1's (2^104) alone moves the model
    np.testing.assert_allclose(out.arrays["w"].numpy(), [-big + 2.0**104], rtol=1e-6)
    assert strategy.memory is not None and strategy.memory.device_ids == ["1"]


def test_fedsag_random_finite_replies_give_a_finite_model_or_none() -> None:
    rng = np.random.default_rng(5)
    for trial in range(30):
        strategy = FedSAG(server_lr=float(rng.uniform(0.5, 2.0)), **KW)
        exps = rng.uniform(30, 38.5, size=3)
        devices = {
            n: _Replies(n - 1, float(rng.choice([-1, 1]) * 10.0 ** exps[n - 1])) for n in (1, 2, 3)
        }
        w = rec(w=np.array([float(rng.choice([-1, 1]) * 10.0 ** rng.uniform(30, 38.5))]))
        out = RoundLoop(strategy, FakeGrid(devices), evaluate_fn=no_eval).run(w, 3)  # type: ignore[arg-type]
        assert np.isfinite(out.arrays["w"].numpy()).all(), f"trial {trial}"


def test_fedsag_keys_a_reply_without_device_id_by_its_node() -> None:
    class Foreign(FakeDevice):  # Flower's quickstart reply: arrays + num-examples only
        def __call__(self, msg: Message) -> Message:
            reply = super().__call__(msg)
            del reply.content["metrics"]["device-id"]
            return reply

    strategy = FedSAG(**KW)
    grid = FakeGrid({7: Foreign(0, 3.0)})
    with by_hand(1):
        msgs = list(strategy.configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), grid))  # type: ignore[arg-type]
        w, _ = strategy.aggregate_train(1, grid.send_and_receive(msgs))
    assert w is not None
    np.testing.assert_allclose(w["w"].numpy(), [3.0])
    assert strategy.memory is not None and strategy.memory.device_ids == ["node-7"]


def test_fedsag_keys_a_reply_without_device_id_by_the_device_bound_to_its_node() -> None:
    """A Flower user's train handler sends no device-id, while EdgeFleet's status query,
    added to that ClientApp, bound its node to device "pi-7": the memory is that device's,
    the one the registry, the rows and register_devices name."""

    class Foreign(FakeDevice):
        def __call__(self, msg: Message) -> Message:
            reply = super().__call__(msg)
            del reply.content["metrics"]["device-id"]
            return reply

    strategy = FedSAG(**KW)
    registry = DeviceRegistry()
    registry.bind(7, "pi-7")
    grid = FakeGrid({7: Foreign(0, 3.0)})
    with by_hand(1, registry):
        msgs = list(strategy.configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), grid))  # type: ignore[arg-type]
        strategy.aggregate_train(1, grid.send_and_receive(msgs))
    assert strategy.memory is not None and strategy.memory.device_ids == ["pi-7"]


def test_fedsag_full_participation_with_memories_equals_fedavg() -> None:
    devices = {i: FakeDevice(i, d) for i, d in enumerate([1.0, -3.0, 0.5, 2.0], start=1)}
    grid = FakeGrid(devices)  # type: ignore[arg-type]
    sag = RoundLoop(FedSAG(**KW), grid, evaluate_fn=no_eval)
    avg = RoundLoop(FedAvg(**KW), grid, evaluate_fn=no_eval)
    # every device uploads every round, so from round 2 on each memory is filled
    w_sag = sag.run(rec(w=np.zeros(3)), 1).arrays
    w_avg = avg.run(rec(w=np.zeros(3)), 1).arrays
    np.testing.assert_allclose(w_sag["w"].numpy(), w_avg["w"].numpy())
    w_sag = sag.run(w_sag, 3, first_round=2).arrays
    w_avg = avg.run(w_avg, 3, first_round=2).arrays
    np.testing.assert_allclose(w_sag["w"].numpy(), w_avg["w"].numpy(), rtol=1e-6)


def test_eh_fedavg_is_the_plain_mean_of_the_participants() -> None:
    class Sized(FakeDevice):  # devices that saw different numbers of samples
        def __call__(self, msg: Message) -> Message:
            reply = super().__call__(msg)
            if msg.metadata.message_type == MessageType.TRAIN:
                reply.content["metrics"]["num-examples"] = 1 + 9 * self.device
            return reply

    devices = {n: Sized(n - 1, d) for n, d in ((1, 1.0), (2, 3.0))}
    out = RoundLoop(EqualWeightFedAvg(**KW), FakeGrid(devices), evaluate_fn=no_eval).run(  # type: ignore[arg-type]
        rec(w=np.zeros(1)), 1
    )
    np.testing.assert_allclose(out.arrays["w"].numpy(), [2.0])  # not (1 + 30) / 11
    weighted = RoundLoop(FedAvg(**KW), FakeGrid(devices), evaluate_fn=no_eval).run(  # type: ignore[arg-type]
        rec(w=np.zeros(1)), 1
    )
    np.testing.assert_allclose(weighted.arrays["w"].numpy(), [31 / 11], rtol=1e-6)
    # what the server builds for strategy = "fedavg" with energy-age selection
    strategy = build_strategy(parse_run_config({"selection.mode": "energy-age"}))
    while hasattr(strategy, "inner"):
        strategy = strategy.inner
    assert type(strategy) is EqualWeightFedAvg


def test_eh_fedavg_used_alone_runs_on_the_screening_loop() -> None:
    class Poisoned(FakeDevice):  # a finite model would be averaged in by Flower's own loop
        def __call__(self, msg: Message) -> Message:
            reply = super().__call__(msg)
            if msg.metadata.message_type == MessageType.TRAIN:
                reply.content["arrays"] = rec(w=np.array([np.nan]))
            return reply

    devices = {1: FakeDevice(0, 1.0), 2: FakeDevice(1, 3.0), 3: Poisoned(2, 0.0)}
    out = EqualWeightFedAvg(**KW).start(
        FakeGrid(devices),  # type: ignore[arg-type]
        rec(w=np.zeros(1)),
        num_rounds=1,
        evaluate_fn=no_eval,
    )
    np.testing.assert_allclose(out.arrays["w"].numpy(), [2.0])  # the NaN reply was screened


def test_energy_age_selection_takes_oldest_feasible_and_resets_ages() -> None:
    # device 3 is never feasible; M = 2 of 4
    devices = {n: FakeDevice(n - 1, 1.0, feasible=(n != 4)) for n in range(1, 5)}
    grid = FakeGrid(devices)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4, seed=0)
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )
    seen = []
    for rnd in range(1, 7):
        out = loop.run(rec(w=np.zeros(1)), rnd, first_round=rnd)
        seen.append(sorted(rows.last(SelectionRow).selected))
        assert out.rounds_run == rnd
    assert all(len(s) == 2 and "3" not in s for s in seen)
    # three feasible devices, two slots: whoever sat out has the largest age next round
    for before, after in zip(seen, seen[1:], strict=False):
        left_out = ({"0", "1", "2"} - set(before)).pop()
        assert left_out in after
    assert devices[4].trains == 0
    assert sum(d.trains for d in devices.values()) == 12


def _selections(node_ids: list[int], rounds: int, **kw: int) -> list[list[str]]:
    """Device ids selected per round; device i sits behind node ``node_ids[i]``, every
    third device is feasible only on odd rounds."""
    plan = [[r % 2 == 1 for r in range(1, rounds + 1)] for _ in node_ids]
    devices = {
        n: FakeDevice(i, 1.0, plan[i] if i % 3 == 0 else True) for i, n in enumerate(node_ids)
    }
    strategy = EnergyAgeSelection(FedAvg(**KW), slots_per_round=4, seed=7, **kw)  # type: ignore[arg-type]
    rows = Rows()
    loop = RoundLoop(
        strategy,
        FakeGrid(devices),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
        callbacks=[*strategy.round_callbacks(), rows],
    )
    seen = []
    for rnd in range(1, rounds + 1):
        loop.run(rec(w=np.zeros(1)), rnd, first_round=rnd)
        seen.append(list(rows.last(SelectionRow).selected))
    return seen


def test_selection_depends_on_device_ids_not_on_flower_node_ids() -> None:
    # The Simulation Engine draws node ids at random each run: one seed, one selection.
    a = _selections(list(range(1, 13)), 6, max_devices=4, batch_size=5)
    b = _selections([9_000_000 + 7 * i for i in range(12)][::-1], 6, max_devices=4, batch_size=5)
    assert a == b
    assert all(len(s) == 4 for s in a)


def test_batched_status_queries_ask_fewer_devices() -> None:
    devices = {n: FakeDevice(n - 1, 1.0) for n in range(1, 21)}
    grid = FakeGrid(devices)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=3, slots_per_round=4, batch_size=4)
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )
    loop.run(rec(w=np.zeros(1)), 1)
    assert rows.last(SelectionRow).status_queries == 20  # round 1: every node, for its id
    loop.run(rec(w=np.zeros(1)), 2, first_round=2)
    assert rows.last(SelectionRow).status_queries == 4  # from then on: the oldest batch only
    assert sum(d.queries for d in devices.values()) == 24
    assert sum(d.trains for d in devices.values()) == 6


def test_a_reconnected_device_retires_its_old_node_id() -> None:
    # device 0 sits behind node 5; the node dies but stays listed (its heartbeat has not
    # expired yet) and the device comes back as node 3
    old, new = FakeDevice(0, 1.0), FakeDevice(0, 1.0)
    other = FakeDevice(1, 1.0)
    grid = FakeGrid({5: old, 7: other})  # type: ignore[dict-item]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4)
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )  # type: ignore[arg-type]
    loop.run(rec(w=np.zeros(1)), 1)
    # While node 5 is listed, device 0's claim from node 3 is refused (as a train reply's
    # would be): the id moves only once its old node is gone.
    grid.handlers = {5: lambda msg: None, 3: new, 7: other}
    loop.run(rec(w=np.zeros(1)), 2, first_round=2)
    assert rows.last(SelectionRow).selected == ["1"]
    assert "bound to node 5, still online" in rows.last(ScreeningRow).status_refused[0]["reason"]
    del grid.handlers[5]  # its heartbeat expired
    for rnd in (3, 4):
        loop.run(rec(w=np.zeros(1)), rnd, first_round=rnd)
        assert sorted(rows.last(SelectionRow).selected) == ["0", "1"]
    assert [m.metadata.dst_node_id for m in grid.sent[-6:]].count(5) == 0
    registry = loop.registry
    assert new.trains == 2 and (registry.device_of(3), registry.device_of(7)) == ("0", "1")
    assert registry.retired == {5}


def test_a_status_answer_claiming_an_online_device_is_refused() -> None:
    """A node that answers the status query with the id of a device whose node is still
    online is refused (the same rule as for train replies): before the registry, energy
    selection moved the id and retired the honest node, so an impostor's one answer took
    a device out of selection for good."""
    honest, impostor = FakeDevice(0, 1.0), FakeDevice(0, 1.0)
    other = FakeDevice(1, 1.0)
    grid = FakeGrid({5: honest, 7: other})  # type: ignore[dict-item]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=3, slots_per_round=4)
    rows = Rows()
    loop = RoundLoop(
        strategy, grid, evaluate_fn=no_eval, callbacks=[*strategy.round_callbacks(), rows]
    )  # type: ignore[arg-type]
    loop.run(rec(w=np.zeros(1)), 1)
    grid.handlers[9] = impostor
    loop.run(rec(w=np.zeros(1)), 2, first_round=2)
    refused = rows.last(ScreeningRow).status_refused
    assert refused == [
        {"device": "node-9", "reason": "device-id 0 is bound to node 5, still online"}
    ]
    assert loop.registry.node_of("0") == 5 and not loop.registry.retired
    assert sorted(rows.last(SelectionRow).selected) == ["0", "1"] and impostor.trains == 0


def test_answers_from_an_outer_query_are_not_asked_again() -> None:
    devices = {n: FakeDevice(n - 1, 1.0, feasible=n % 2 == 0) for n in range(1, 7)}
    grid = FakeGrid(devices)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4, batch_size=2)
    # an outer component (sessions) needs every node's status: the phase asks all first
    outer = Declaration("Sessions", status=True, every_node=True)
    phase = StatusPhase(strategy, [outer, *strategy.declarations()])
    with by_hand(1) as ctx:
        phase.run(grid, 1, rec(w=np.zeros(1)))  # type: ignore[arg-type]
        msgs = list(strategy.configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), grid))  # type: ignore[arg-type]
    assert ctx.section(SelectionRow).status_queries == 0
    assert sum(d.queries for d in devices.values()) == 6  # the outer query only
    assert len(msgs) == 2 and all(m.metadata.dst_node_id % 2 == 0 for m in msgs)


def _context(state: RecordDict | None = None, **run_config: object) -> Context:
    cfg = {"selection.mode": "energy-age", "energy.capacity": 4.0, "energy.train-slots": 3}
    cfg.update(run_config)  # type: ignore[arg-type]
    node = {"partition-id": 0, "num-partitions": 5, "harvest-prob": 0.0}
    return Context(
        run_id=1, node_id=1, node_config=node, state=state or RecordDict(), run_config=cfg
    )


def _ins(kind: str, config: dict, arrays: ArrayRecord | None = None) -> Message:
    content = RecordDict({"config": ConfigRecord(config)})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, dst_node_id=1, message_type=kind)


def test_client_battery_feasibility_boundary_and_decline_spends_nothing() -> None:
    FakeGrid({})  # sets the task identity that building messages needs
    ctx = _context()  # capacity 4 = exactly one round (3 + 1), no harvest
    # Through the ClientApp, as Flower calls it: the energy mod runs around the handlers.
    reply = app(_ins(MessageType.QUERY, {"slot": 0, "server-round": 1}), ctx)
    assert reply.content["status"]["feasible"] == 1
    assert reply.content["status"]["battery-level"] == 4.0
    from edgefleet.client.device import get_device
    from edgefleet.task.train import get_arrays

    arrays = get_arrays(get_device(ctx.run_config, ctx.node_config).model)
    config = {"slot": 4, "server-round": 1}
    first = app(_ins(MessageType.TRAIN, config, arrays), ctx)
    assert not first.has_error()
    assert first.content["metrics"]["energy-spent"] == 4.0
    # one unit short now (empty battery, no harvest): decline with an error, spend nothing
    second = app(_ins(MessageType.TRAIN, {"slot": 8, "server-round": 2}, arrays), ctx)
    assert second.has_error() and "battery" in second.error.reason
    assert ctx.state.config_records["edgefleet.battery"]["level"] == 0.0
    assert ctx.state.config_records["edgefleet.battery"]["spent_total"] == 4.0
    reply = app(_ins(MessageType.QUERY, {"slot": 12, "server-round": 3}), ctx)
    assert reply.content["status"]["feasible"] == 0


def test_error_reply_is_declined() -> None:
    def declines(msg: Message) -> Message:
        return Message(Error(12, "battery empty"), reply_to=msg)

    grid = FakeGrid({1: declines})
    loop = RoundLoop(FedSAG(**KW), grid, evaluate_fn=no_eval)
    out = loop.run(rec(w=np.ones(1)), 1)
    np.testing.assert_array_equal(out.arrays["w"].numpy(), [1.0])


def test_wrapper_state_includes_fedsag_memory() -> None:
    devices = {1: FakeDevice(0, 1.0), 2: FakeDevice(1, 2.0)}
    grid = FakeGrid(devices)  # type: ignore[arg-type]
    strategy = EnergyAgeSelection(FedSAG(**KW), max_devices=2, slots_per_round=4)
    RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=strategy.round_callbacks()).run(
        rec(w=np.zeros(1)), 1
    )
    state = strategy.state_dict()
    assert sorted(state["inner"]["memory"]["device_ids"]) == ["0", "1"]
    assert state["ages"]["ages"] == {"0": 0, "1": 0}


@pytest.mark.parametrize("bad_id", [-1, 2.5, [1, 2]])
def test_malformed_status_leaves_the_device_out_without_ending_the_run(bad_id: object) -> None:
    class BadDeviceId(FakeDevice):
        def __call__(self, msg: Message) -> Message:
            if msg.metadata.message_type == MessageType.QUERY:
                status = MetricRecord({"feasible": 1, "device-id": bad_id})  # type: ignore[dict-item]
                return Message(RecordDict({"status": status}), reply_to=msg)
            return super().__call__(msg)

    devices = {1: FakeDevice(0, 1.0), 2: BadDeviceId(1, 2.0)}
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4)
    loop = RoundLoop(
        strategy,
        FakeGrid(devices),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
        callbacks=strategy.round_callbacks(),
    )
    out = loop.run(rec(w=np.zeros(1)), 2, ConfigRecord())
    assert devices[1].trains == 2 and devices[2].trains == 0
    np.testing.assert_allclose(out.arrays["w"].numpy(), [2.0])


def test_status_without_device_id_is_keyed_by_node() -> None:
    """A ClientApp that does not report a device id (a standard Flower app) takes part under
    ``node-<id>``, in its status answer and in its train replies alike."""

    class Anonymous(FakeDevice):
        def __call__(self, msg: Message) -> Message:
            reply = super().__call__(msg)
            for record in reply.content.metric_records.values():
                del record["device-id"]
            return reply

    devices = {1: FakeDevice(0, 1.0), 2: Anonymous(1, 2.0)}
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=1, slots_per_round=4)
    loop = RoundLoop(
        strategy,
        FakeGrid(devices),  # type: ignore[arg-type]
        evaluate_fn=no_eval,
        callbacks=strategy.round_callbacks(),
    )
    loop.run(rec(w=np.zeros(1)), 2, ConfigRecord())
    # Ages follow both ids, so the two devices take turns.
    assert devices[1].trains == 1 and devices[2].trains == 1
    assert (loop.registry.device_of(1), loop.registry.name(2)) == ("0", "node-2")


def test_unreadable_energy_trace_is_an_error_reply_not_a_crash(tmp_path) -> None:
    FakeGrid({})
    node = {"partition-id": 0, "num-partitions": 5, "energy-source": "trace"}
    node["trace-path"] = str(tmp_path / "missing.csv")
    ctx = Context(
        run_id=1,
        node_id=1,
        node_config=node,
        state=RecordDict(),
        run_config={"selection.mode": "energy-age"},
    )
    reply = app(_ins(MessageType.QUERY, {"slot": 0, "server-round": 1}), ctx)
    assert reply.has_error() and reply.error.code == 10
    reply = app(_ins(MessageType.TRAIN, {"slot": 0, "server-round": 1}, rec(w=np.zeros(1))), ctx)
    assert reply.has_error() and reply.error.code == 10


class SlowStartGrid(FakeGrid):
    """Nodes whose ClientApps are still starting: a message whose wait is shorter than
    ``startup`` gets no answer (its first answer needs that long); records every wait."""

    def __init__(self, handlers, startup: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(handlers)
        self.startup, self.waits, self.started = startup, [], False

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        messages = list(messages)
        self.waits.append(timeout)
        if not self.started and (timeout or 0) < self.startup:
            self.sent.extend(messages)
            return []
        self.started = True
        return super().send_and_receive(messages, timeout=timeout)


def test_a_status_query_waits_for_a_starting_node_then_uses_its_normal_timeout() -> None:
    """A node's first answer waits for its ClientApp to start (``first_timeout``), later
    ones use the normal timeout: a loaded machine must not empty the first rounds."""
    devices = {1: FakeDevice(0, 1.0), 2: FakeDevice(1, 1.0)}
    grid = SlowStartGrid(devices, startup=100.0)
    query = StatusQuery(4, timeout=60.0, first_timeout=600.0)
    registry = DeviceRegistry()
    with by_hand(1, registry):
        assert set(query.ask(grid, [1, 2], 1)) == {1, 2}  # type: ignore[arg-type]
    with by_hand(2, registry):
        assert set(query.ask(grid, [1, 2], 2)) == {1, 2}  # type: ignore[arg-type]
    assert grid.waits == [600.0, 60.0]
    # Without first_timeout (the earlier behaviour) the starting nodes are given up on.
    late = SlowStartGrid(dict(devices), startup=100.0)
    with by_hand(1):
        assert StatusQuery(4, timeout=60.0).ask(late, [1, 2], 1) == {}  # type: ignore[arg-type]


def test_a_round_that_selects_nobody_says_why_in_its_row() -> None:
    # Every device answers but none can afford a round; then none answers at all.
    devices = {n: FakeDevice(n - 1, 1.0, feasible=False) for n in (1, 2, 3)}
    strategy = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4)
    callbacks = strategy.round_callbacks()
    loop = RoundLoop(strategy, FakeGrid(devices), evaluate_fn=no_eval, callbacks=callbacks)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    for cb in callbacks:
        cb.after_round(result)
    assert result.participants == []
    assert "none of the 3 devices that answered can afford a round" in str(
        result.context.section(ScreeningRow).no_participants
    )
    silent = EnergyAgeSelection(FedAvg(**KW), max_devices=2, slots_per_round=4)
    grid = FakeGrid({n: (lambda m: None) for n in (1, 2)})
    loop = RoundLoop(silent, grid, evaluate_fn=no_eval, callbacks=silent.round_callbacks())  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    silent.after_round(result)
    assert "none of the 2 nodes answered the status query" in str(
        result.context.section(ScreeningRow).no_participants
    )


def test_a_round_whose_replies_all_decline_says_so() -> None:
    def decline(msg: Message) -> Message:
        return Message(Error(11, "no battery"), reply_to=msg)

    loop = RoundLoop(FedAvg(**KW), FakeGrid({1: decline, 2: decline}), evaluate_fn=no_eval)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    assert (
        result.context.section(ScreeningRow).no_participants
        == "none of the 2 replies was usable (declined or rejected)"
    )


def test_a_hostile_status_answer_is_ignored_not_fatal() -> None:
    """Status answers with inf, NaN or absurd labels, or a non-integer device id, are ignored
    with a warning; the honest node's answer stands."""

    def answering(status: dict):  # type: ignore[no-untyped-def]
        return lambda msg: Message(RecordDict({"status": MetricRecord(status)}), reply_to=msg)

    grid = FakeGrid(
        {
            1: answering({"device-id": 1, "labels": [float("inf")]}),
            2: answering({"device-id": 2, "labels": [float("nan")]}),
            3: answering({"device-id": 3.5}),
            4: answering({"device-id": 4, "labels": [0, 1]}),
        }
    )
    with by_hand(1):
        answers = StatusQuery(4, timeout=5.0).ask(grid, [1, 2, 3, 4], 1, labels=True)  # type: ignore[arg-type]
    assert set(answers) == {4} and answers[4].labels == (0, 1)
