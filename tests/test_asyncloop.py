"""Asynchronous buffered aggregation (FedBuff, issue 45): staleness weights, the server step,
and the loop on the in-process engine's grids (a virtual-time grid for arrival order)."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg, FedMedian

from edgefleet.loop.asyncloop import AsyncLoop
from edgefleet.loop.roundloop import LoopOutcome
from edgefleet.loop.staleness import (
    AsyncSettingError,
    AsyncSettings,
    fedbuff_step,
    staleness_weight,
)
from edgefleet.simulation.inprocess import Handler, InProcessGrid, answer
from edgefleet.simulation.virtualtime import VirtualTimeGrid
from edgefleet.strategies import FedBuff
from edgefleet.strategies.equalweight import EqualWeightFedAvg
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.robust import RobustAggregation
from edgefleet.wire import DISPATCH
from tests.fakes import Rows, UploadingGrid, rec, train_reply

# -- staleness weights: hand-computed ---------------------------------------------------------


def test_polynomial_weights_by_hand() -> None:
    # (1 + s)^-a: a = 0.5 is FedBuff's 1/sqrt(1 + s).
    assert staleness_weight("polynomial", 0, a=0.5) == 1.0
    assert staleness_weight("polynomial", 3, a=0.5) == pytest.approx(0.5)
    assert staleness_weight("polynomial", 8, a=0.5) == pytest.approx(1 / 3)
    assert staleness_weight("polynomial", 1, a=2.0) == pytest.approx(0.25)
    assert staleness_weight("polynomial", 5, a=0.0) == 1.0


def test_constant_and_hinge_weights_by_hand() -> None:
    assert staleness_weight("constant", 0) == staleness_weight("constant", 99) == 1.0
    # FedAsync's hinge: 1 up to b, then 1 / (a (s - b) + 1).
    assert staleness_weight("hinge", 4, a=10, b=4) == 1.0
    assert staleness_weight("hinge", 5, a=10, b=4) == pytest.approx(1 / 11)
    assert staleness_weight("hinge", 7, a=0.5, b=2) == pytest.approx(1 / 3.5)


def test_bad_settings_name_the_choices() -> None:
    with pytest.raises(AsyncSettingError, match="polynomial, constant, hinge"):
        AsyncSettings(staleness="linear")
    with pytest.raises(AsyncSettingError, match="buffer_size"):
        AsyncSettings(buffer_size=0)
    with pytest.raises(AsyncSettingError, match="server_lr"):
        AsyncSettings(server_lr=float("nan"))
    with pytest.raises(ValueError, match="staleness -1"):
        staleness_weight("constant", -1)
    with pytest.raises(AsyncSettingError, match="valid: constant, cosine"):
        AsyncSettings(server_lr_schedule="linear")
    with pytest.raises(AsyncSettingError, match="server_lr_min=0.6 .* from 0 to server_lr"):
        AsyncSettings(server_lr=0.5, server_lr_min=0.6, server_lr_schedule="cosine")


def test_cosine_server_step_by_hand() -> None:
    """From server_lr at version 1 towards server_lr_min, reached one version after the last:
    lr_v = min + (lr - min) (1 + cos(pi (v - 1) / N)) / 2."""
    s = AsyncSettings(server_lr=1.0, server_lr_min=0.25, server_lr_schedule="cosine")
    got = [s.server_lr_at(v, 4) for v in (1, 2, 3, 4)]
    assert got == pytest.approx([1.0, 0.25 + 0.375 * (1 + 0.5**0.5), 0.625,
                                 0.25 + 0.375 * (1 - 0.5**0.5)])  # fmt: skip
    assert AsyncSettings(server_lr=0.5, server_lr_min=0.1).server_lr_at(3, 4) == 0.5


# -- the loop ---------------------------------------------------------------------------------

W0 = np.array([0.0, 0.0], dtype=np.float32)


def mover(step: np.ndarray, n: int):  # type: ignore[no-untyped-def]
    """A device whose training adds ``step`` to the model it got, from ``n`` examples."""

    def handler(msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        return train_reply(msg, rec(w=w + step), n, **{"train-loss": 0.5})

    return handler


def test_fedbuff_step_by_hand() -> None:
    """One version from a buffer of two: device 1 fresh (s = 0), device 2 one version old
    (s = 1), polynomial a = 1 -> weights 1 and 1/2; FedAvg weights 1 and 3 examples; lr 0.5."""
    s = AsyncSettings(buffer_size=2, concurrency=2, staleness="polynomial", a=1.0, server_lr=0.5)
    x = {"w": np.array([1.0, 2.0])}
    d1, d2 = {"w": np.array([1.0, 0.0])}, {"w": np.array([0.0, 4.0])}
    got = fedbuff_step(x, [d1, d2], [1, 3], [0, 1], s)
    # x + 0.5 * (1 * 1 * d1 + 3 * 0.5 * d2) / 4 = [1 + 0.125, 2 + 0.75]
    np.testing.assert_allclose(got["w"], [1.125, 2.75])


def test_loop_step_equals_fedbuff_by_hand() -> None:
    """The loop's composition (rebase onto x, Flower's FedAvg, server lr) is FedBuff's step.

    Nodes 1 and 2 start on version 0. Node 1 (1 s, 1 example, +[1, 0]) answers at t = 1,
    again at 2, 3, ...; node 2 (2.5 s, 3 examples, +[0, 4]) at t = 2.5. Buffer 2: version 1 is
    node 1's two fresh updates; node 2's update on version 0 then arrives one version old."""
    s = AsyncSettings(buffer_size=2, concurrency=2, staleness="polynomial", a=1.0, server_lr=0.5)
    grid = VirtualTimeGrid(
        {1: mover(np.array([1.0, 0.0]), 1), 2: mover(np.array([0.0, 4.0]), 3)},
        lambda node, k: 1.0 if node == 1 else 2.5,
    )
    rows = Rows()
    loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock, sleep=lambda _: None)
    out = loop.run(rec(w=W0), 2)
    v1 = rows.results[0].arrays["w"].numpy()
    # Version 1: node 1 at t=1 (base v0) and t=2 (base v0 too: no version yet): both fresh.
    np.testing.assert_allclose(v1, [0.0, 0.0] + 0.5 * np.array([1.0, 0.0]))
    assert rows.results[0].extra["staleness_max"] == 0
    # Version 2: node 2 (base v0, s = 1) at t = 2.5, node 1 (base v1, s = 0) at t = 3.
    want = fedbuff_step(
        {"w": v1.astype(np.float64)},
        [{"w": np.array([0.0, 4.0])}, {"w": np.array([1.0, 0.0])}],
        [3, 1],
        [1, 0],
        s,
    )
    np.testing.assert_allclose(out.arrays["w"].numpy(), want["w"], rtol=1e-6)
    r2 = rows.results[1].extra
    assert (r2["staleness_min"], r2["staleness_max"], r2["accepted"]) == (0, 1, 2)
    assert r2["server_lr"] == 0.5


def test_the_loop_takes_the_cosine_step_of_each_version() -> None:
    """Two versions of one device's fresh +[1, 0] updates (buffer 1): the steps are the
    schedule's (1 then 0.5 at lr 1 -> 0 over 2 versions), and each row says which it took."""
    s = AsyncSettings(buffer_size=1, concurrency=1, server_lr_schedule="cosine")
    grid = VirtualTimeGrid({1: mover(np.array([1.0, 0.0]), 1)}, lambda node, k: 1.0)
    rows = Rows()
    loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock, sleep=lambda _: None)
    out = loop.run(rec(w=W0), 2)
    assert [r.extra["server_lr"] for r in rows.results] == pytest.approx([1.0, 0.5])
    np.testing.assert_allclose(out.arrays["w"].numpy(), [1.5, 0.0])


def test_participation_weights_by_hand() -> None:
    """Interval in versions x K / n, within [1/cap, cap]; 1 without the option."""
    s = AsyncSettings(buffer_size=2, participation="interval", participation_cap=4.0)
    assert s.participation_weight(20, 1, 4) == 4.0  # 1 update in 20 versions: 10, capped
    assert s.participation_weight(12, 3, 4) == 2.0  # interval 4 x 2 / 4
    assert s.participation_weight(10, 10, 2) == 1.0  # interval 1 x 2 / 2: an equal share
    assert s.participation_weight(10, 40, 2) == 0.25  # 1/4 x 2 / 2 = 1/4: the floor 1/cap
    assert s.participation_weight(10, 80, 2) == 0.25
    assert s.participation_weight(20, 1, 4, since=18) == 1.0  # joined at 18: interval 2
    with pytest.raises(ValueError, match="version 5 since 5"):
        s.participation_weight(5, 1, 4, since=5)
    assert AsyncSettings().participation_weight(20, 1, 4) == 1.0
    with pytest.raises(AsyncSettingError, match="participation 'fedau'; valid: none, interval"):
        AsyncSettings(participation="fedau")
    with pytest.raises(AsyncSettingError, match="participation_cap=0.5 must be"):
        AsyncSettings(participation="interval", participation_cap=0.5)


def test_the_loop_weights_a_rare_device_by_its_participation_interval() -> None:
    """Buffer 1, no staleness discount. Node 1 (+[1, 0]) answers at t = 1, 2, 3: versions
    1-3 take it with weight 1 (interval 1, one device, K = 1). Node 2 (+[0, 1]) answers at
    t = 3.5 with its first update: version 4, interval 4 in a fleet of 2 -> weight 4 x 1 / 2
    = 2. Without the option it counts once."""

    def run(participation: str) -> np.ndarray:
        grid = VirtualTimeGrid(
            {1: mover(np.array([1.0, 0.0]), 1), 2: mover(np.array([0.0, 1.0]), 1)},
            lambda node, k: 1.0 if node == 1 else 3.5,
        )
        s = AsyncSettings(buffer_size=1, concurrency=2, staleness="constant",
                          participation=participation)  # fmt: skip
        loop = AsyncLoop(FedAvg(), grid, s, clock=grid.clock, sleep=lambda _: None)
        return loop.run(rec(w=W0), 4).arrays["w"].numpy()

    np.testing.assert_allclose(run("interval"), [3.0, 2.0])
    np.testing.assert_allclose(run("none"), [3.0, 1.0])


class _ComingAndGoing(VirtualTimeGrid):
    """Node 1 always connected; node 2 leaves at t = 2; node 3 arrives at t = 3.2."""

    def get_node_ids(self) -> list[int]:
        return [n for n in (1, 2, 3) if (n == 1 or (n == 2 and self.now < 2)
                                         or (n == 3 and self.now >= 3.2))]  # fmt: skip


def test_participation_weights_count_from_arrival_and_forget_who_left() -> None:
    """Buffer 1, each device its own direction, so a coordinate of the model is the sum of
    its device's weights. Node 1 answers each second; node 2 once at t = 1.5, then leaves
    (its next message never returns); node 3 is first seen at t = 4 (version 5) and answers
    at 4.5. Weights, interval x K / n:
    v1 node 1: 1/1 x 1/1 = 1;      v2 node 2: 2/1 x 1/2 = 1 (nodes 1, 2 connected)
    v3 node 1: 3/2 x 1/1 = 1.5 (node 2 gone: n = 1, not 2);  v4: 4/3;  v5: 5/4
    v6 node 3: (6 - 5)/1 x 1/2 = 0.5 (its interval from its arrival: not 6/1 x 1/3 = 2)."""
    durations = {1: lambda k: 1.0, 2: lambda k: 1.5 if k == 0 else 1000.0, 3: lambda k: 0.5}
    grid = _ComingAndGoing(
        {n: mover(np.eye(3, dtype=np.float32)[n - 1], 1) for n in (1, 2, 3)},
        lambda node, k: durations[node](k),
    )
    s = AsyncSettings(buffer_size=1, concurrency=3, staleness="constant",
                      participation="interval", participation_cap=100.0)  # fmt: skip
    rows = Rows()
    loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock, sleep=lambda _: None)
    out = loop.run(rec(w=np.zeros(3, np.float32)), 6).arrays["w"].numpy()
    assert [r.extra["accepted"] for r in rows.results] == [1] * 6
    np.testing.assert_allclose(out, [1 + 1.5 + 4 / 3 + 1.25, 1.0, 0.5], rtol=1e-6)


def test_participation_weights_beside_a_server_memory_are_refused() -> None:
    """FedSAG's memory (and MIFA's, FedVARP's) already counts each device's last update in
    every version: the library refuses the interval weight beside it before the first one."""
    from edgefleet.strategies.fedsag import FedSAG
    from edgefleet.strategies.mifa import MIFA

    grid = VirtualTimeGrid({1: mover(np.array([1.0, 0.0]), 1)}, lambda node, k: 1.0)
    for memory in (FedSAG(), MIFA()):
        with pytest.raises(ValueError, match=f"with {type(memory).__name__}'s memory"):
            AsyncLoop(memory, grid, AsyncSettings(participation="interval"))
        AsyncLoop(memory, grid, AsyncSettings())  # without the weights it composes


def _noisy_fleet(seed: int, nodes: int = 5) -> VirtualTimeGrid:
    rng = np.random.default_rng(seed)
    steps = {n: rng.normal(size=2).astype(np.float32) for n in range(1, nodes + 1)}
    times = rng.lognormal(0.0, 1.0, size=(nodes + 1, 64))
    return VirtualTimeGrid(
        {n: mover(steps[n], n) for n in steps}, lambda node, k: float(times[node, k])
    )


def _run(seed: int, versions: int = 6, **kw: object) -> list[dict[str, object]]:
    grid = _noisy_fleet(seed)
    rows = Rows()
    s = AsyncSettings(buffer_size=2, concurrency=3, **kw)  # type: ignore[arg-type]
    loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock, sleep=lambda _: None)
    loop.run(rec(w=W0), versions)
    return [
        {"w": r.arrays["w"].numpy().tolist(), "who": r.participants, **r.extra, "t": r.wall_s}
        for r in rows.results
    ]


def test_seeded_arrival_order_gives_the_same_versions_twice() -> None:
    first, second = _run(3), _run(3)
    assert len(first) == 6
    assert first == second
    assert _run(4) != first  # the seed matters: the test can fail
    assert max(r["staleness_max"] for r in first) > 0  # it is asynchronous


def test_a_ten_times_slower_device_does_not_slow_the_versions() -> None:
    """Four devices, one 10x slower: versions come at the pace of the three fast ones (the
    same virtual times as a fleet without the slow one), and the slow one's update still
    counts once it arrives, discounted by its staleness."""

    def fleet(slow: bool) -> tuple[list[float], list[list[str]], list[int]]:
        handlers = {n: mover(np.array([1.0, 0.0], np.float32), 1) for n in (1, 2, 3)}
        if slow:
            handlers[4] = mover(np.array([0.0, 1.0], np.float32), 1)
        grid = VirtualTimeGrid(handlers, lambda node, k: 10.0 if node == 4 else 1.0)
        rows = Rows()
        s = AsyncSettings(buffer_size=3, concurrency=len(handlers))
        loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock,
                         sleep=lambda _: None)  # fmt: skip
        loop.run(rec(w=W0), 12)
        return (
            [r.wall_s for r in rows.results],
            [[str(n) for n in r.participant_nodes] for r in rows.results],
            [int(r.extra["staleness_max"]) for r in rows.results],  # type: ignore[call-overload]
        )

    t_slow, who, stale = fleet(slow=True)
    t_fast, _, _ = fleet(slow=False)
    assert len(t_slow) == len(t_fast) == 12
    # Versions at the fast devices' pace: never later than without the slow device.
    assert all(a <= b for a, b in zip(t_slow, t_fast, strict=True))
    slow_in = [i for i, nodes in enumerate(who) if "4" in nodes]
    assert slow_in, "the slow device's update was never aggregated"
    assert stale[slow_in[0]] >= 5  # it trained on a model many versions old


def test_max_staleness_drops_with_reason() -> None:
    handlers = {n: mover(np.array([1.0, 0.0], np.float32), 1) for n in (1, 2, 3, 4)}
    grid = VirtualTimeGrid(handlers, lambda node, k: 10.0 if node == 4 else 1.0)
    rows = Rows()
    s = AsyncSettings(buffer_size=3, concurrency=4, max_staleness=2)
    AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock,
              sleep=lambda _: None).run(rec(w=W0), 12)  # fmt: skip
    rejected = [x for r in rows.results for x in r.rejected]
    assert any("max-staleness 2" in x["reason"] and x["device"] == "node-4" for x in rejected)
    assert all(4 not in r.participant_nodes for r in rows.results)


def test_a_bad_reply_is_dropped_and_the_run_goes_on() -> None:
    def nan(msg: Message) -> Message:
        return train_reply(msg, rec(w=np.array([np.nan, 0.0])), 1)

    def declines(msg: Message) -> Message:
        from flwr.app import Error

        return Message(Error(code=0, reason="battery low"), reply_to=msg)

    handlers = {1: mover(np.array([1.0, 0.0], np.float32), 1), 2: nan, 3: declines}
    grid = VirtualTimeGrid(handlers, lambda node, k: 1.0)
    rows = Rows()
    s = AsyncSettings(buffer_size=2, concurrency=3)
    out = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock,
                    sleep=lambda _: None).run(rec(w=W0), 3)  # fmt: skip
    assert out.rounds_run == 3 and np.isfinite(out.arrays["w"].numpy()).all()
    assert any(r.rejected for r in rows.results) and any(r.declined for r in rows.results)
    assert all(set(r.participant_nodes) == {1} for r in rows.results)


def test_an_unreachable_device_is_its_own_outcome() -> None:
    """Flower's transport error (a killed SuperNode) is not the device's decline."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    def gone(msg: Message) -> Message:
        return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="x" * 5000), reply_to=msg)

    handlers = {1: mover(np.array([1.0, 0.0], np.float32), 1), 2: gone}
    grid = VirtualTimeGrid(handlers, lambda node, k: 1.0)
    rows = Rows()
    s = AsyncSettings(buffer_size=1, concurrency=2)
    AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock,
              sleep=lambda _: None).run(rec(w=W0), 3)  # fmt: skip
    assert any(r.unreachable for r in rows.results)
    assert not any(r.declined for r in rows.results)


def test_the_library_refuses_wrappers_that_need_a_round_barrier() -> None:
    """Compose or refuse, for a user's FedBuff(...) too: before the first version."""
    from edgefleet.loop.base import LoopStrategy
    from edgefleet.loop.status import Declaration
    from edgefleet.strategies.energy_selection import EnergyAgeSelection
    from edgefleet.strategies.scaffold import Scaffold

    class Presence(LoopStrategy):  # a wrapper that reads a round's status, as sessions do
        def own_declarations(self) -> list[Declaration]:
            return [Declaration("Presence", status=True, every_node=True)]

    grid = VirtualTimeGrid({1: mover(np.array([1.0, 0.0], np.float32), 1)}, lambda n, k: 1.0)
    s = AsyncSettings(buffer_size=1, concurrency=1)
    with pytest.raises(ValueError, match="Presence needs the round loop's status phase"):
        AsyncLoop(Presence(FedAvg()), grid, s)
    late = EnergyAgeSelection(FedAvg(), max_devices=2, slots_per_round=4, deadline=5.0)
    with pytest.raises(ValueError, match=r"deadline=5\) skips devices .* use deadline=0"):
        AsyncLoop(late, grid, s)
    AsyncLoop(EnergyAgeSelection(FedAvg(), max_devices=2, slots_per_round=4), grid, s)
    with pytest.raises(ValueError, match="Scaffold"):
        AsyncLoop(Scaffold(local_steps=2, lr=0.1), grid, s)


# -- energy-age selection: who starts when a slot frees ---------------------------------------


def _battery_fleet(prob: float, capacity: float = 4.0):  # type: ignore[no-untyped-def]
    """Four real devices (a ClientApp with EdgeFleet's energy mod and status query: a seeded
    harvesting battery, a round costs 3 units) that add 1 to the model, node 100 + i taking
    1 + i virtual seconds a message."""
    from flwr.app import Context, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from edgefleet.client.mods import energy_mod, status_query
    from edgefleet.simulation.inprocess import ClientAppNode

    app = ClientApp(mods=[energy_mod(capacity=capacity, harvest_prob=prob, train_slots=2)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content.array_records["arrays"]["w"].numpy()
        metrics = MetricRecord({"num-examples": 10})
        return Message(RecordDict({"arrays": rec(w=w + 1), "metrics": metrics}), reply_to=msg)

    app.query()(status_query)
    nodes = {
        100 + i: ClientAppNode(app, Context(1, 100 + i, {"device-id": i}, RecordDict(), {}), 1)
        for i in range(4)
    }
    grid = VirtualTimeGrid(nodes, lambda node, k: 1.0 + (node - 100))
    # A status query's pull returns the first answer only (the clock is virtual): poll again
    # at once rather than after the deployment grid's real 0.5 s.
    grid.pull_interval = 0.001  # type: ignore[attr-defined]
    return grid


def _energy_run(  # type: ignore[no-untyped-def]
    prob: float, versions: int, capacity: float = 4.0, max_empty: int = 0, inner=FedAvg
):
    from edgefleet.strategies.energy_selection import EnergyAgeSelection

    grid = _battery_fleet(prob, capacity)
    kw = {"min_available_nodes": 1, "min_train_nodes": 1}
    strategy = EnergyAgeSelection(inner(**kw), max_devices=4, slots_per_round=3, seed=3)
    rows = Rows()
    loop = AsyncLoop(strategy, grid, AsyncSettings(buffer_size=2, concurrency=3),
                     callbacks=[rows], clock=grid.clock, sleep=lambda _: None,
                     max_empty=max_empty)  # fmt: skip
    return loop.run(rec(w=np.zeros(1, np.float32)), versions), rows.results, loop


def test_async_energy_age_starts_only_devices_that_can_afford_a_round() -> None:
    """Scarce energy (P_h 0.3 a slot, 0.9 units a clock round against a cost of 3): the loop
    asks the idle devices' batteries as slots free, starts only those that can pay, and the
    slot clock moves on when nobody trains and nobody can pay, so batteries refill."""
    from edgefleet.loop.context import SelectionRow

    out, rows, loop = _energy_run(prob=0.3, versions=8)
    assert out.rounds_run == 8 and out.stop_reason == "budget"
    assert not any(r.declined for r in rows)  # nobody sent a model it could not pay for
    updates = sum(len(r.participants) for r in rows)
    assert sum(r.energy_spent for r in rows) == 3 * updates  # every update paid its round
    slots = [r.extra["slot"] for r in rows]
    assert slots == sorted(slots)  # the clock never goes back (a battery refuses that)
    # more than a round of the clock (3 slots) a version: it moved on while nobody could pay
    assert loop._ticks > 0 and slots[-1] > 3 * len(rows)
    chosen = [r.context.section(SelectionRow) for r in rows]
    assert sum(c.status_queries for c in chosen) > 0
    assert {d for r in rows for d in r.participants} == {"0", "1", "2", "3"}
    # One seeded arrival order and seeded batteries: the same run twice.
    again, rows2, _ = _energy_run(prob=0.3, versions=8)
    assert [r.participants for r in rows2] == [r.participants for r in rows]
    np.testing.assert_array_equal(again.arrays["w"].numpy(), out.arrays["w"].numpy())


def test_eh_fedsag_runs_async() -> None:
    """EH-FedSAG (energy-age selection around FedSAG) in async mode: each version moves the
    model by the memory's mean (every device adds 1 to the model it got, so every update is
    +1 and the SAGA direction is +1 too) times the staleness weight of its buffer."""
    out, rows, _ = _energy_run(prob=0.3, versions=6, inner=FedSAG)
    assert out.rounds_run == 6 and not any(r.declined for r in rows)
    w = float(out.arrays["w"].numpy()[0])
    assert 3.0 <= w <= 6.0, w  # six versions of a step of at most 1, stale ones discounted


def test_async_energy_age_asks_a_silent_node_once_a_clock_round() -> None:
    """A node listed online that never answers (a dead board until its heartbeat expires)
    costs the loop a status query's timeout each time it is asked: once per clock round,
    not once per poll."""
    from edgefleet.strategies.energy_selection import EnergyAgeSelection

    grid = _battery_fleet(0.3)
    asked: list[int] = []
    grid.handlers[200] = lambda msg: asked.append(1)  # type: ignore[index, func-returns-value]
    kw = {"min_available_nodes": 1, "min_train_nodes": 1}
    strategy = EnergyAgeSelection(FedAvg(**kw), max_devices=4, slots_per_round=3, seed=3,
                                  query_timeout=0.02)  # fmt: skip
    loop = AsyncLoop(strategy, grid, AsyncSettings(buffer_size=2, concurrency=3),
                     clock=grid.clock, sleep=lambda _: None, max_empty=0)  # fmt: skip
    out = loop.run(rec(w=np.zeros(1, np.float32)), 6)
    assert out.rounds_run == 6
    assert 0 < len(asked) <= 6 + loop._ticks  # one clock round before each version, + ticks


def test_async_energy_age_ends_a_run_whose_fleet_cannot_pay() -> None:
    """No harvest: each device pays for one round from its full battery and never again;
    the run ends after run.max-empty-rounds slot-clock rounds in a row, saying why."""
    out, rows, _ = _energy_run(prob=0.0, versions=10, capacity=3.0, max_empty=3)
    assert out.rounds_run == 2  # four updates, buffers of two
    assert "3 slot-clock rounds in a row no idle device could afford to train" in out.stop_reason
    assert not any(r.declined for r in rows)


@pytest.mark.parametrize(
    "inner",
    [
        lambda: EqualWeightFedAvg(min_available_nodes=1, min_train_nodes=1),
        lambda: RobustAggregation(FedAvg(), "median"),
        lambda: FedMedian(),
        lambda: FedSAG(min_available_nodes=1, min_train_nodes=1),
        lambda: MIFA(min_available_nodes=1, min_train_nodes=1),
        lambda: FedVARP(min_available_nodes=1, min_train_nodes=1),
    ],
    ids=["equal-weight", "robust-median", "flower-fedmedian", "fedsag", "mifa", "fedvarp"],
)
def test_inner_strategies_compose(inner) -> None:  # type: ignore[no-untyped-def]
    """FedAvg-family aggregators, robust rules over the buffer and FedSAG's memory all make
    versions that move towards the devices' common direction."""
    handlers = {n: mover(np.array([1.0, 1.0], np.float32), 2) for n in (1, 2, 3)}
    grid = VirtualTimeGrid(handlers, lambda node, k: float(node))
    s = AsyncSettings(buffer_size=3, concurrency=3)
    out = AsyncLoop(inner(), grid, s, clock=grid.clock, sleep=lambda _: None).run(rec(w=W0), 4)
    w = out.arrays["w"].numpy()
    assert out.rounds_run == 4 and np.all(w > 0.5), w


def test_fedbuff_wraps_a_flower_strategy() -> None:
    """The library entry: FedBuff(FedAvg()).start(...) with Flower's default FedAvg (which
    would wait for 2 nodes when sampling 1) and Flower's Result."""
    handlers = {n: mover(np.array([1.0, 0.0], np.float32), 1) for n in (1, 2)}
    grid = VirtualTimeGrid(handlers, lambda node, k: float(node))
    seen = []

    def evaluate(version: int, arrays: ArrayRecord):  # type: ignore[no-untyped-def]
        from flwr.app import MetricRecord

        seen.append(version)
        return MetricRecord({"w0": float(arrays["w"].numpy()[0])})

    result = FedBuff(FedAvg(), buffer_size=2, concurrency=2, staleness="constant").start(
        grid, rec(w=W0), num_rounds=3, evaluate_fn=evaluate, poll_s=0.001
    )
    assert seen == [0, 1, 2, 3]
    assert result.arrays["w"].numpy()[0] == pytest.approx(3.0)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]


# -- run config: keys and refusals ------------------------------------------------------------


def test_async_keys_parse_and_bad_values_name_the_choices() -> None:
    from edgefleet.config import ConfigError, parse_run_config

    cfg = parse_run_config({"aggregation.mode": "async", "async.staleness": "hinge"})
    assert cfg.aggregation.enabled and cfg.aggregation.staleness == "hinge"
    assert not parse_run_config({}).aggregation.enabled
    with pytest.raises(ConfigError, match="must be one of sync, async"):
        parse_run_config({"aggregation.mode": "fedbuff"})
    with pytest.raises(ConfigError, match="must be one of polynomial, constant, hinge"):
        parse_run_config({"async.staleness": "exponential"})
    with pytest.raises(ConfigError, match="async.buffer-size"):
        parse_run_config({"async.buffer-size": 0})
    with pytest.raises(ConfigError, match="must be one of constant, cosine"):
        parse_run_config({"async.server-lr-schedule": "step"})
    with pytest.raises(ConfigError, match="async.server-lr-min = 2.0 is above async.server-lr"):
        parse_run_config({"async.server-lr-min": 2.0})
    both = {"async.participation": "interval", "async.participation-cap": 2.0}
    settings = AsyncSettings.from_config(parse_run_config(both).aggregation)
    assert (settings.participation, settings.participation_cap) == ("interval", 2.0)
    with pytest.raises(ConfigError, match="must be one of none, interval"):
        parse_run_config({"async.participation": "fedau"})
    with pytest.raises(ConfigError, match="async.participation-cap"):
        parse_run_config({"async.participation-cap": 0.5})


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"selection.mode": "energy-age", "selection.deadline": 5.0}, "selection.deadline"),
        ({"pruning.keep-ratio": 0.5, "pruning.reconstruction": "zeros"}, "CA-HFP"),
        ({"pruning.keep-ratios": "1.0,0.5", "pruning.reconstruction": "elementwise"}, "CA-HFP"),
        ({"pruning.keep-ratio": 0.5, "pruning.compact-download": True}, "compact-download"),
        ({"sessions.rounds": 3}, "sessions"),
        ({"warmstart.mode": "pilot"}, "sessions"),
        ({"stopping.mode": "observe"}, "stopping.mode = 'observe'"),
        ({"stopping.mode": "validation"}, "stopping.mode = 'validation'"),
        ({"fraction-evaluate": 0.5}, "fraction-evaluate"),
        ({"strategy": "scaffold"}, "strategy = 'scaffold'"),
        ({"strategy": "fedsag", "async.participation": "interval"}, "async.participation"),
    ],
)
def test_async_refuses_what_it_does_not_support(keys: dict[str, object], named: str) -> None:
    from edgefleet.config import ConfigError, parse_run_config

    parse_run_config(keys)  # fine in sync mode
    with pytest.raises(ConfigError, match="aggregation.mode = 'async' does not yet support") as e:
        parse_run_config({"aggregation.mode": "async", **keys})
    assert named in str(e.value)


class ThreadedGrid(InProcessGrid):
    """Each pushed message runs on its own thread at once; a pull returns the replies that
    are done (real time, real sleeps: the loop's polling path, not the virtual clock)."""

    synchronous = False

    def __init__(self, handlers: dict[int, Handler]) -> None:
        super().__init__(handlers)
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.futures: dict[str, Future[Message | None]] = {}

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = super().push_messages(messages)
        for mid in ids:
            msg = self._pushed.pop(mid)
            handler = self.handlers[msg.metadata.dst_node_id]
            self.futures[mid] = self.pool.submit(answer, handler, msg)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        out = []
        for mid in list(message_ids):
            fut = self.futures.get(mid)
            if fut is not None and fut.done():
                del self.futures[mid]
                if (reply := fut.result()) is not None:
                    out.append(reply)
        return out


def test_a_sleeping_slow_device_does_not_hold_the_versions_back() -> None:
    """Real threads and sleeps: the slow device sleeps 10x as long as the three fast ones.
    Counted, not timed: in the time of its first update, the fast ones make several versions
    (about 10 x 3 / 3; at least 2 holds unless the fast sleeps overrun 5x)."""
    order: list[int] = []

    def sleeper(node: int, seconds: float):  # type: ignore[no-untyped-def]
        inner = mover(np.array([1.0, 0.0], np.float32), 1)

        def handler(msg: Message) -> Message:
            time.sleep(seconds)
            order.append(node)
            return inner(msg)

        return handler

    grid = ThreadedGrid({1: sleeper(1, 0.05), 2: sleeper(2, 0.05), 3: sleeper(3, 0.05),
                         4: sleeper(4, 0.5)})  # fmt: skip
    rows = Rows()
    s = AsyncSettings(buffer_size=3, concurrency=4)
    try:
        AsyncLoop(FedAvg(), grid, s, callbacks=[rows], poll_s=0.005).run(rec(w=W0), 12)
    finally:
        grid.pool.shutdown(wait=True)
    assert len(rows.results) == 12
    slow_version = next(i for i, r in enumerate(rows.results) if 4 in r.participant_nodes)
    assert slow_version >= 2, [r.participant_nodes for r in rows.results]
    assert rows.results[slow_version].extra["staleness_max"] >= 2


def test_a_slow_upload_does_not_hold_the_other_replies_back() -> None:
    """Node 4's reply takes until version 4 to upload: pulled in the background, the three
    fast devices make versions 1-4 meanwhile. Pulled in the loop's thread, the first poll
    would wait out the upload and version 1 would hold node 4 (the test then fails after
    ``limit`` seconds, not hangs)."""
    step = np.array([1.0, 0.0], np.float32)
    grid = UploadingGrid({n: mover(step, 1) for n in (1, 2, 3, 4)}, slow=4, limit=20.0)

    class Release(Rows):
        def after_round(self, result):  # type: ignore[no-untyped-def]
            if len(self.results) == 3:
                grid.uploaded.set()
            return super().after_round(result)

    rows = Release()
    s = AsyncSettings(buffer_size=2, concurrency=4)
    loop = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], poll_s=0.005, background_pull=True)
    loop.run(rec(w=W0), 6)
    nodes = [r.participant_nodes for r in rows.results]
    assert len(nodes) == 6
    assert all(4 not in v for v in nodes[:4]), nodes
    assert any(4 in v for v in nodes[4:]), nodes


def test_only_flowers_deployment_grid_is_pulled_in_the_background(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from edgefleet.loop.pulling import pulls_wait_on_uploads
    from edgefleet.loop.roundloop import BoundedGrid

    class HttpGrid(InProcessGrid):  # stands in for flwr.superlink.grid.HttpGrid
        pass

    assert not pulls_wait_on_uploads(HttpGrid())  # the module not imported: cannot be one
    monkeypatch.setitem(sys.modules, "flwr.superlink.grid.http_grid",
                        types.SimpleNamespace(HttpGrid=HttpGrid))  # fmt: skip
    assert pulls_wait_on_uploads(HttpGrid())
    assert pulls_wait_on_uploads(BoundedGrid(HttpGrid(), timeout=1.0))  # through a wrapper
    assert not pulls_wait_on_uploads(InProcessGrid())
    assert not AsyncLoop(FedAvg(), InProcessGrid(), AsyncSettings()).background_pull
    assert AsyncLoop(FedAvg(), HttpGrid(), AsyncSettings()).background_pull


def test_messages_come_from_the_inner_strategy_and_never_wait_for_nodes() -> None:
    """One node and Flower's FedProx with its default min_available_nodes = 2 (its own
    sampling would wait for a second node for good): the device gets FedProx's config, with
    server-round = the version being built."""
    from flwr.serverapp.strategy import FedProx

    seen: list[tuple[float, int, int]] = []

    def device(msg: Message) -> Message:
        config = msg.content["config"]
        seen.append(
            (float(config["proximal-mu"]), int(config["server-round"]), int(config[DISPATCH]))
        )
        return mover(np.array([1.0, 0.0], np.float32), 1)(msg)

    grid = VirtualTimeGrid({7: device}, lambda node, k: 1.0)
    s = AsyncSettings(buffer_size=1, concurrency=4)
    out = AsyncLoop(FedProx(proximal_mu=0.25), grid, s, clock=grid.clock,
                    sleep=lambda _: None).run(rec(w=W0), 3)  # fmt: skip
    assert out.rounds_run == 3
    # Each message numbered: a device sent one version twice must not repeat its batches.
    assert seen == [(0.25, 1, 1), (0.25, 2, 2), (0.25, 3, 3)]


def test_data_free_stopping_watches_the_versions() -> None:
    """TaskVectorStopping around the aggregator: its rule runs on every version's model and
    stops the asynchronous run on a plateau (devices that stop moving the model)."""
    from edgefleet.loop.context import StoppingRow
    from edgefleet.strategies.stopping import TaskVectorStopping

    def fading(msg: Message) -> Message:  # the k-th version's step is 0.5 ** k
        w = msg.content["arrays"]["w"].numpy()
        k = int(msg.content["config"]["server-round"])
        return train_reply(msg, rec(w=w + np.float32(0.5**k)), 1)

    grid = VirtualTimeGrid({1: fading, 2: fading}, lambda node, k: float(node))
    rows = Rows()
    stop = TaskVectorStopping(FedAvg(), tau=0.05, patience=2, keys=["w"])
    s = AsyncSettings(buffer_size=2, concurrency=2, staleness="constant")
    out = AsyncLoop(stop, grid, s, callbacks=[rows], clock=grid.clock,
                    sleep=lambda _: None).run(rec(w=W0), 30)  # fmt: skip
    assert out.stop_reason != "budget" and out.rounds_run < 30
    norms = [r.context.section(StoppingRow).task_vector_norm for r in rows.results]
    assert all(n is not None for n in norms) and norms == sorted(norms)


def test_a_decaying_server_step_slows_the_task_vector_and_data_free_stopping_sees_it() -> None:
    """The composition the how-to warns of: devices that keep moving the model by the same
    step never plateau at a constant server step (relative growth 1/v > tau over 30
    versions), but the cosine to 0 shrinks each version's step, so the rule stops the run
    before its budget. Both train; the stop is the schedule's doing, not the fleet's."""
    from edgefleet.strategies.stopping import TaskVectorStopping

    def run(schedule: str) -> LoopOutcome:
        grid = VirtualTimeGrid({1: mover(np.array([1.0, 0.0]), 1)}, lambda node, k: 1.0)
        stop = TaskVectorStopping(FedAvg(), tau=0.02, patience=2, keys=["w"])
        s = AsyncSettings(buffer_size=1, concurrency=1, server_lr_schedule=schedule)
        loop = AsyncLoop(stop, grid, s, clock=grid.clock, sleep=lambda _: None)
        return loop.run(rec(w=W0), 30)

    assert run("constant").stop_reason == "budget"
    cosine = run("cosine")
    assert cosine.stop_reason != "budget" and cosine.rounds_run < 30


def test_a_device_that_never_answers_loses_its_slot_while_the_others_go_on() -> None:
    handlers = {n: mover(np.array([1.0, 0.0], np.float32), 1) for n in (1, 2)}
    handlers[3] = lambda msg: None  # gone: its message is never answered
    grid = VirtualTimeGrid(handlers, lambda node, k: 1.0)
    rows = Rows()
    s = AsyncSettings(buffer_size=2, concurrency=3)
    out = AsyncLoop(FedAvg(), grid, s, callbacks=[rows], clock=grid.clock, reply_timeout=3.0,
                    sleep=lambda _: None).run(rec(w=W0), 6)  # fmt: skip
    assert out.rounds_run == 6
    timed_out = [x for r in rows.results for x in r.rejected if x["device"] == "node-3"]
    assert timed_out and all(x["reason"] == "no reply within 3 s" for x in timed_out)


def test_a_fleet_whose_every_reply_is_dropped_ends_with_the_reason() -> None:
    """No round budget bounds an asynchronous run's work: a fleet that only declines or
    sends garbage ends the run (with why) instead of being re-sent models for ever."""

    def nan(msg: Message) -> Message:
        return train_reply(msg, rec(w=np.array([np.nan, 0.0])), 1)

    grid = VirtualTimeGrid({1: nan, 2: nan}, lambda node, k: 1.0)
    s = AsyncSettings(buffer_size=2, concurrency=2)
    out = AsyncLoop(FedAvg(), grid, s, clock=grid.clock, sleep=lambda _: None).run(rec(w=W0), 5)
    assert out.rounds_run == 0
    assert out.stop_reason == "the last 40 replies were all declined or dropped (see the log)"


# -- checkpoint and resume mid-buffer ---------------------------------------------------------


class _Stopped(Exception):
    """The ServerApp killed right after a checkpoint was written."""


class _Pushes(VirtualTimeGrid):
    """Keeps each pushed message's node and model."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.pushed: list[tuple[int, np.ndarray]] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        for m in messages:
            self.pushed.append((m.metadata.dst_node_id, m.content["arrays"]["w"].numpy()))
        return super().push_messages(messages)


STEPS = {n: np.array([float(n), -0.5 * n], np.float32) for n in (1, 2, 3, 4)}


def _mid_buffer_fleet() -> _Pushes:
    # Node n answers in n virtual seconds with n examples; concurrency 3 of 4 nodes.
    return _Pushes({n: mover(STEPS[n], n) for n in STEPS}, lambda node, k: float(node))


def test_a_run_stopped_mid_buffer_resumes_with_its_buffer_and_resends_in_flight(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Stopped after two of version 2's three updates were accepted: the checkpoint (the
    safe .npz format, read back from disk) holds both replies and the devices in flight;
    resumed, the run first re-sends the checkpoint's model to those devices, and version 2
    is the FedBuff step over the two kept updates (with their staleness) and the first
    re-sent one, by hand."""
    from edgefleet.server.checkpoint import (
        FILENAME,
        Checkpointer,
        apply_checkpoint,
        load_checkpoint,
    )

    s = AsyncSettings(buffer_size=3, concurrency=3, staleness="polynomial", a=1.0)
    grid = _mid_buffer_fleet()
    strategy = FedAvg()
    ckpt = Checkpointer(tmp_path, strategy)
    saves: list[int] = []

    def checkpoint(version: int, arrays: ArrayRecord) -> None:
        ckpt.save(version, arrays)
        saves.append(version)
        if saves.count(1) == 2:  # two updates buffered towards version 2
            raise _Stopped

    rows = Rows()
    loop = AsyncLoop(strategy, grid, s, callbacks=[rows, ckpt], clock=grid.clock,
                     sleep=lambda _: None, checkpoint=checkpoint)  # fmt: skip
    ckpt.loop_state = loop.state_dict
    with pytest.raises(_Stopped):
        loop.run(rec(w=W0), 4)
    saved = load_checkpoint(tmp_path / FILENAME)
    assert saved.round == 1 and len(rows.results) == 1
    kept = saved.loop["buffer"]["entries"]
    assert len(kept) == 2
    in_flight = saved.loop["in_flight"]
    assert in_flight and saved.loop["version"] == 1
    v1 = rows.results[0].arrays["w"].numpy()
    np.testing.assert_array_equal(saved.arrays["w"], v1)

    resumed_grid = _mid_buffer_fleet()
    rows2 = Rows()
    strategy2 = FedAvg()
    loop2 = AsyncLoop(strategy2, resumed_grid, s, callbacks=[rows2], clock=resumed_grid.clock,
                      sleep=lambda _: None)  # fmt: skip
    apply_checkpoint(saved, strategy2, ["w"], loop2)
    loop2.run(saved.array_record(), 3, first_version=2)
    # The devices that were training get the checkpoint's model first, in their order.
    first = resumed_grid.pushed[: len(in_flight)]
    assert [n for n, _ in first] == in_flight
    for _, w in first:
        np.testing.assert_array_equal(w, v1)
    # Version 2: the two kept updates, then the first re-sent device's (staleness 0).
    r2 = rows2.results[0]
    assert r2.round == 2
    assert r2.participants[:2] == [e["device"] for e in kept]
    third = r2.participant_nodes[2]
    assert third == min(in_flight)  # node n answers in n seconds
    nodes = [e["node"] for e in kept] + [third]
    stale = [e["staleness"] for e in kept] + [0]
    want = fedbuff_step({"w": v1.astype(np.float64)}, [{"w": STEPS[n]} for n in nodes],
                        nodes, stale, s)  # fmt: skip
    np.testing.assert_allclose(r2.arrays["w"].numpy(), want["w"], rtol=1e-6)
    assert r2.extra["accepted"] == 3 and r2.extra["staleness_max"] == max(stale)
    assert [r.round for r in rows2.results] == [2, 3]


def test_the_buffer_in_a_checkpoint_is_bounded_and_checked() -> None:
    """A checkpoint whose buffer holds more replies than the run's buffer size is refused
    (it is not this run's), and one from before this format loads with an empty buffer."""
    grid = _mid_buffer_fleet()
    loop = AsyncLoop(FedAvg(), grid, AsyncSettings(buffer_size=3, concurrency=3))
    state = loop.state_dict()
    assert state["buffer"] == {"bases": {}, "entries": []} and state["in_flight"] == []
    entry = {"device": "1", "staleness": 0, "version": 0, "node": 1, "records": []}
    bases = {"0": {"keys": ["w"], "values": [W0]}}
    with pytest.raises(ValueError, match="4 buffered replies > async.buffer-size 3"):
        loop.load_state_dict({**state, "buffer": {"bases": bases, "entries": [entry] * 4}})
    with pytest.raises(ValueError, match="3 buffered replies > async.buffer-size 3 - 1"):
        loop.load_state_dict({**state, "buffer": {"bases": bases, "entries": [entry] * 3}})
    with pytest.raises(ValueError, match="4 devices in flight > async.concurrency 3"):
        loop.load_state_dict({**state, "in_flight": [1, 2, 3, 4]})
    # The row so far is data from a file: typed and bounded as it is read back.
    hostile = {"declined": ["x" * 10_000] * 20_000, "dropped_more": "7",
               "rejected": [{"device": "d", "reason": "r" * 10_000}] * 50}  # fmt: skip
    loop.load_state_dict({**state, "period": {**state["period"], **hostile}})
    period = loop._restored["period"]
    assert len(period.declined) == 10_000 and max(map(len, period.declined)) == 128
    assert len(period.rejected) == 20 and period.dropped_more == 7
    assert all(len(r["reason"]) <= 500 for r in period.rejected)
    loop.load_state_dict({"registry": {}, "norms": []})  # an older checkpoint's loop state
    out = loop.run(rec(w=W0), 1)
    assert out.rounds_run == 1
