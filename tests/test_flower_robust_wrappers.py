"""Flower's own robust strategies (``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``MultiKrum``,
``Bulyan``) as the inner strategy under every EdgeFleet wrapper (issue 25): data-free
stopping, energy-age selection, sessions with warm start, and the round loop's screening
alone. Each run is checked against the Flower strategy's own ``aggregate_train`` over the
very replies of that round (rebuilt from the train messages the fake nodes got), and round 1
also against the hand-computed rule below, so a wrapper that bypassed or altered the rule
fails. Screening drops a NaN reply or a x1e6 update before the rule sees it; under
CA-HFP's ``SubmodelReconstruction`` each Flower robust strategy is refused when it is built,
naming the ``robust.rule`` to use instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Strategy

from edgefleet.loop.base import start_on_loop
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.strategies import (
    EnergyAgeSelection,
    LoopStrategy,
    SessionStore,
    SessionTracker,
    SubmodelReconstruction,
    TaskVectorStopping,
    WarmStartInitializer,
)
from tests.fakes import FakeGrid, Rows, rec

# Seven devices' updates over three coordinates (and their num-examples); device 6 is the
# attacker, inside the default norm bound (|d6| = 14.1, 3.9 x the median update norm 3.7).
DELTAS = {
    0: ([1.0, 2.0, 3.0], 1),
    1: ([2.0, 1.0, 2.5], 2),
    2: ([3.0, 3.5, 1.0], 3),
    3: ([1.5, 2.5, 2.0], 4),
    4: ([2.5, 0.5, 3.5], 1),
    5: ([4.0, 3.0, 2.75], 2),
    6: ([-9.0, 9.0, -6.0], 3),
}
# Krum's scores (n = 7, f = 1: the squared distances to each one's 4 nearest neighbours):
# 18.5625, 14.5625, 28.3125, 15.5625, 22.5625, 28.5, 927 -> best first 1, 3, 0, 4, 2, 5, 6.
# Each rule's update in round 1 from the zero model, by hand:
WANT = {
    # sorted columns [-9,1,1.5,2,2.5,3,4] [.5,1,2,2.5,3,3.5,9] [-6,1,2,2.5,2.75,3,3.5]
    "FedMedian": [2.0, 2.5, 2.5],
    # int(0.2 x 7) = 1 cut each end: the mean of the middle five
    "FedTrimmedAvg": [2.0, 2.4, 2.25],
    "Krum": [2.0, 1.0, 2.5],  # device 1, the best score
    # devices 1, 3, 0 with weights 2, 4, 1: (2 x d1 + 4 x d3 + d0) / 7
    "MultiKrum": [11 / 7, 2.0, 16 / 7],
    # MultiKrum picks theta = 7 - 2 = 5 (devices 1, 3, 0, 4, 2); median (2, 2, 2.5); per
    # coordinate the mean of the beta = 5 - 2 = 3 nearest it: (2,1.5,2.5) (2,2.5,1) (2.5,2,3)
    "Bulyan": [2.0, 11 / 6, 2.5],
}
FEDAVG = [0.21875, 3.625, 0.625]  # what the weighted mean would give: the attacker wins

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "FedMedian": lambda: FedMedian(fraction_evaluate=0.0),
    "FedTrimmedAvg": lambda: FedTrimmedAvg(beta=0.2, fraction_evaluate=0.0),
    "Krum": lambda: Krum(num_malicious_nodes=1, fraction_evaluate=0.0),
    "MultiKrum": lambda: MultiKrum(
        num_malicious_nodes=1, num_nodes_to_select=3, fraction_evaluate=0.0
    ),
    "Bulyan": lambda: Bulyan(num_malicious_nodes=1, fraction_evaluate=0.0),  # n = 7 >= 4f + 3
}
NAMES = list(STRATEGIES)


class Node:
    """A device that trains by adding a fixed update, answers EdgeFleet's status query with
    its plan (feasible, present: a bool or one per round) and keeps each train message."""

    def __init__(
        self,
        device: int,
        delta: list[float],
        n: int,
        *,
        feasible: bool | list[bool] = True,
        present: bool = True,
        bad: str | None = None,
    ) -> None:
        self.device, self.delta, self.n = device, np.asarray(delta), n
        self.feasible, self.present, self.bad = feasible, present, bad
        self.trained: dict[int, Message] = {}  # round -> the train message it got

    def __call__(self, msg: Message) -> Message:
        rnd = int(msg.content["config"]["server-round"])  # type: ignore[arg-type]
        if msg.metadata.message_type == MessageType.QUERY:
            ok = self.feasible if isinstance(self.feasible, bool) else self.feasible[rnd - 1]
            status = MetricRecord(
                {"device-id": self.device, "battery-level": 5.0, "feasible": int(ok),
                 "present": int(self.present)}
            )  # fmt: skip
            return Message(RecordDict({"status": status}), reply_to=msg)
        assert msg.metadata.message_type == MessageType.TRAIN, "only train and query are sent"
        self.trained[rnd] = msg
        return self.reply(msg)

    def reply(self, msg: Message) -> Message:
        """The reply to a train message, as Flower's quickstart shapes one."""
        w = msg.content["arrays"]["w"].numpy().astype(np.float64)  # type: ignore[union-attr]
        if self.bad == "nan":
            w = w + np.array([np.nan, 0.0, 0.0])
        elif self.bad == "huge":
            w = w + 1e6 * self.delta
        else:
            w = w + self.delta
        metrics = MetricRecord(
            {"num-examples": self.n, "train-loss": 1.0, "device-id": self.device}
        )
        return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)


def fleet(extra: dict[int, Node] | None = None) -> dict[int, Node]:
    """The seven devices of ``DELTAS`` on nodes 1-7 (device d on node d + 1), plus ``extra``
    (by node id)."""
    nodes = {d + 1: Node(d, delta, n) for d, (delta, n) in DELTAS.items()}
    return {**nodes, **(extra or {})}


def flowers_own(name: str, nodes: dict[int, Node], rnd: int) -> np.ndarray:
    """A fresh ``name``'s own aggregate of round ``rnd``'s replies (rebuilt from the train
    messages the nodes got, in device order, as the round loop hands them on)."""
    trained = sorted(
        (node for node in nodes.values() if rnd in node.trained), key=lambda n: n.device
    )
    replies = [node.reply(node.trained[rnd]) for node in trained]
    arrays, _ = STRATEGIES[name]().aggregate_train(rnd, replies)
    assert arrays is not None, f"{name} aggregated nothing of {len(replies)} replies"
    return arrays["w"].numpy()


def run(strategy: Strategy, nodes: dict[int, Node], rounds: int) -> dict[int, np.ndarray]:
    """``strategy`` started as a Flower user starts it (its wrappers' ``start()``; a bare
    Flower strategy on EdgeFleet's round loop, which screens every reply); the model after
    each round, as the central evaluation saw it (round 0: the initial model)."""
    models: dict[int, np.ndarray] = {}

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        models[rnd] = arrays["w"].numpy().copy()
        return MetricRecord({"accuracy": 0.5})

    initial = rec(w=np.zeros(3))
    grid = FakeGrid(nodes)  # type: ignore[arg-type]
    if isinstance(strategy, LoopStrategy):  # an EdgeFleet wrapper
        result = strategy.start(grid, initial, num_rounds=rounds, evaluate_fn=evaluate)
    else:
        result = start_on_loop(strategy, grid, initial, num_rounds=rounds, evaluate_fn=evaluate)
    assert sorted(result.train_metrics_clientapp) == list(range(1, rounds + 1))
    assert sorted(result.evaluate_metrics_serverapp) == list(range(rounds + 1))
    for rnd in range(1, rounds + 1):
        # A round that kept the very model object it started from is not evaluated again.
        models.setdefault(rnd, models[rnd - 1])
    np.testing.assert_allclose(result.arrays["w"].numpy(), models[rounds])
    return models


def check_round(name: str, nodes: dict[int, Node], models: dict[int, np.ndarray], rnd: int) -> None:
    """The model after ``rnd`` is Flower's own rule over that round's replies."""
    np.testing.assert_allclose(models[rnd], flowers_own(name, nodes, rnd), rtol=1e-6, atol=1e-6)


# --- the hand table is Flower's own rule --------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_hand_table_is_what_flowers_strategy_computes(name: str) -> None:
    FakeGrid({})  # the task's ids, which a Message needs
    nodes = fleet()
    start = rec(w=np.zeros(3))
    for node in nodes.values():
        node.trained[1] = Message(
            RecordDict({"arrays": start}), dst_node_id=1, message_type=MessageType.TRAIN
        )
    np.testing.assert_allclose(flowers_own(name, nodes, 1), WANT[name], rtol=1e-6)
    assert not np.allclose(WANT[name], FEDAVG, atol=0.1)


# --- under each wrapper -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_under_the_round_loops_screening_alone(name: str) -> None:
    nodes = fleet()
    models = run(STRATEGIES[name](), nodes, rounds=3)
    np.testing.assert_allclose(models[1], WANT[name], rtol=1e-6)
    for rnd in (1, 2, 3):
        check_round(name, nodes, models, rnd)
    # every rule here moves a translated fleet by the same update: 3 rounds, 3 updates
    np.testing.assert_allclose(models[3], 3 * np.asarray(WANT[name]), rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_under_task_vector_stopping(name: str) -> None:
    nodes = fleet()
    models = run(TaskVectorStopping(STRATEGIES[name](), patience=2), nodes, rounds=3)
    check_round(name, nodes, models, 1)
    np.testing.assert_allclose(models[1], WANT[name], rtol=1e-6)
    # growth 100 % then 50 %: never below tau, the run uses its 3 rounds
    np.testing.assert_allclose(models[3], 3 * np.asarray(WANT[name]), rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_under_energy_age_selection(name: str) -> None:
    """Nine nodes, M = 7: device 7 can never afford a round, device 8 not in round 1. Round 1
    selects the seven of the table; round 2 device 8 (the oldest feasible) and six of them."""
    nodes = fleet(
        {
            8: Node(7, [0.0, 0.0, 0.0], 1, feasible=False),
            9: Node(8, [2.0, 2.0, 2.0], 1, feasible=[False, True, True]),
        }
    )
    strategy = EnergyAgeSelection(STRATEGIES[name](), max_devices=7, slots_per_round=4)
    models = run(strategy, nodes, rounds=3)
    np.testing.assert_allclose(models[1], WANT[name], rtol=1e-6)
    check_round(name, nodes, models, 1)
    assert not nodes[8].trained and 1 not in nodes[9].trained and 2 in nodes[9].trained
    for rnd in (2, 3):
        assert sum(rnd in node.trained for node in nodes.values()) == 7
        check_round(name, nodes, models, rnd)


@pytest.mark.parametrize("name", NAMES)
def test_under_sessions_and_warm_start(name: str, tmp_path: Path) -> None:
    """Eight nodes, device 7 absent: the seven of the table train. Sessions of two rounds:
    round 3 opens session 2 with an auxiliary round from the pilot model (session 1's final
    model, 2 updates); with one pilot and nothing stored to weigh, session 2 starts from the
    previous model, so round 4 ends at 3 updates."""
    nodes = fleet({8: Node(7, [5.0, 5.0, 5.0], 1, present=False)})
    initial = rec(w=np.zeros(3))
    strategy = WarmStartInitializer(
        STRATEGIES[name](),
        store=tmp_path / "sessions",
        initial=initial,
        tracker=SessionTracker(change_threshold=0.2, max_rounds=2),
        pilot_sessions=1,
    )
    models = run(strategy, nodes, rounds=4)
    want = np.asarray(WANT[name])
    np.testing.assert_allclose(models[1], want, rtol=1e-6)
    check_round(name, nodes, models, 1)
    assert not nodes[8].trained
    # the auxiliary round trained from 2 updates (its result is the pseudo-gradient only)
    assert all(3 in node.trained for d, node in nodes.items() if d != 8)
    aux_sent = nodes[1].trained[3].content["arrays"]["w"].numpy()  # type: ignore[union-attr]
    np.testing.assert_allclose(aux_sent, 2 * want, rtol=1e-5)
    for rnd, k in ((2, 2), (3, 2), (4, 3)):
        np.testing.assert_allclose(models[rnd], k * want, rtol=1e-5, err_msg=f"round {rnd}")
    # session 1 stored at round 3's boundary, session 2 when the run ended
    assert SessionStore.open(tmp_path / "sessions", 10).last_session() == 2


# --- screening stands in front of the rule ----------------------------------------------------


@pytest.mark.parametrize("bad", ["nan", "huge"])
@pytest.mark.parametrize("name", NAMES)
def test_screening_drops_a_nan_or_huge_reply_before_flowers_rule(name: str, bad: str) -> None:
    """An eighth node replies with a NaN or with its update x 1e6: rejected by screening, so
    the rule sees the seven of the table and gives the table's result."""
    seen: list[list[int]] = []
    inner = STRATEGIES[name]()
    flowers_aggregate = inner.aggregate_train

    def spy(server_round: int, replies):
        replies = list(replies)
        seen.append(sorted(m.metadata.src_node_id for m in replies))
        return flowers_aggregate(server_round, replies)

    inner.aggregate_train = spy  # type: ignore[method-assign]
    nodes = fleet({8: Node(7, [1.0, 1.0, 1.0], 1, bad=bad)})
    rows = Rows()
    loop = RoundLoop(inner, FakeGrid(nodes), callbacks=[rows])  # type: ignore[arg-type]
    out = loop.run(rec(w=np.zeros(3)), 1)
    assert seen == [[1, 2, 3, 4, 5, 6, 7]]
    (rejected,) = rows.results[0].rejected
    assert rejected["device"] == "7"
    assert ("non-finite" if bad == "nan" else "x the round's median") in rejected["reason"]
    np.testing.assert_allclose(out.arrays["w"].numpy(), WANT[name], rtol=1e-6)
    honest = {k: node for k, node in nodes.items() if k != 8}
    np.testing.assert_allclose(out.arrays["w"].numpy(), flowers_own(name, honest, 1), rtol=1e-6)


# --- CA-HFP: refused when built, naming the rule ----------------------------------------------

RULE = {
    "FedMedian": "median",
    "FedTrimmedAvg": "trimmed-mean",
    "Krum": "multikrum",
    "MultiKrum": "multikrum",
    "Bulyan": "multikrum",
}


def _never_planned():
    raise AssertionError("the plan is never needed: the build is refused")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "inside",
    [
        lambda s: s,
        lambda s: TaskVectorStopping(s),
        lambda s: EnergyAgeSelection(s, max_devices=7, slots_per_round=4),
    ],
    ids=["bare", "stopping", "energy"],
)
def test_reconstruction_refuses_flowers_robust_strategy_naming_the_rule(name, inside) -> None:
    with pytest.raises(ValueError, match=rf"Flower's {name}.*robust.rule = '{RULE[name]}'"):
        SubmodelReconstruction(inside(STRATEGIES[name]()), _never_planned)


def test_bulyan_under_a_selection_cap_it_cannot_reach_is_refused_before_round_1() -> None:
    nodes = fleet()
    strategy = EnergyAgeSelection(Bulyan(num_malicious_nodes=1), max_devices=5, slots_per_round=4)
    with pytest.raises(ValueError, match=r"needs at least 7 replies a round \(4f \+ 3\), but at "
                       r"most 5 devices.*max_devices to 7 or more, or set num_malicious_nodes "
                       r"to 0 or less"):  # fmt: skip
        run(strategy, nodes, rounds=2)
    assert not any(node.trained for node in nodes.values())  # nothing was sent
    # At the cap Bulyan needs, it runs.
    ok = EnergyAgeSelection(Bulyan(num_malicious_nodes=1), max_devices=7, slots_per_round=4)
    assert sorted(run(ok, fleet(), rounds=1)) == [0, 1]
