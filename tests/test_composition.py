"""Components compose: every pair of EdgeFleet's Flower wrappers, and the full stack, trains in
a Flower user's own app.

The app is written as Flower's NumPy quickstart would write it (a softmax regression on
scikit-learn's digits; replies carry ``arrays`` and ``num-examples``), with EdgeFleet's
energy mod and status query added where a wrapper needs a battery or a device's presence
(the README's own-app table). It runs on the in-process engine (the same ClientApp calls as
Flower's engines, no Ray), six devices, a few rounds: each combination must have
participants in every round and end more accurate than it started.
"""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Strategy

from edgefleet.client.mods import energy_mod, status_query
from edgefleet.simulation.inprocess import ClientAppGrid
from edgefleet.strategies import (
    EnergyAgeSelection,
    FedSAG,
    RobustAggregation,
    SessionLearningRate,
    SessionStore,
    SessionTracker,
    SubmodelReconstruction,
    TaskVectorStopping,
    WarmStartInitializer,
)

NODES = 6
ROUNDS = 5
CLASSES = 10
ONE = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}

# -- the user's app: Flower's NumPy quickstart, on the digits -----------------------------------


@cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)


def _local(partition: int, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = _digits()
    idx = np.arange(600)[partition::partitions]  # 100 images a device
    return x[idx], y[idx]


def _test_set() -> tuple[np.ndarray, np.ndarray]:
    x, y = _digits()
    return x[1400:], y[1400:]


def _logits(arrays: ArrayRecord, x: np.ndarray) -> np.ndarray:
    return x @ arrays["w"].numpy() + arrays["b"].numpy()


def _accuracy(arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> float:
    return float((_logits(arrays, x).argmax(1) == y).mean())


def _train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    w, b = arrays["w"].numpy().copy(), arrays["b"].numpy().copy()
    x, y = _local(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    lr = float(msg.content["config"].get("lr", 0.5))  # type: ignore[arg-type]
    for _ in range(5):  # full-batch gradient steps of softmax regression
        z = x @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        w -= lr * x.T @ p / len(y)
        b -= lr * p.mean(0)
    out = ArrayRecord({"w": Array(w.astype(np.float32)), "b": Array(b.astype(np.float32))})
    metrics = MetricRecord({"train_loss": 0.0, "num-examples": len(y)})
    return Message(RecordDict({"arrays": out, "metrics": metrics}), reply_to=msg)


def _evaluate(msg: Message, context: Context) -> Message:
    x, y = _local(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    acc = _accuracy(msg.content["arrays"], x, y)
    metrics = MetricRecord({"eval_acc": acc, "num-examples": len(y)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def user_app(with_energy: bool) -> ClientApp:
    """The user's ClientApp; ``with_energy``: EdgeFleet's battery mod and status query added
    (a battery that harvests a round's cost every round, so every device can always train)."""
    mods = [energy_mod(capacity=8, harvest_prob=1.0)] if with_energy else []
    app = ClientApp(mods=mods)
    app.train()(_train)
    app.evaluate()(_evaluate)
    if with_energy:
        app.query()(status_query)
    return app


def initial_model() -> ArrayRecord:
    w = np.random.default_rng(1).normal(0, 0.01, (64, CLASSES)).astype(np.float32)
    return ArrayRecord({"w": Array(w), "b": Array(np.zeros(CLASSES, np.float32))})


def central(_: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"accuracy": _accuracy(arrays, *_test_set())})


# -- the stacks -----------------------------------------------------------------------------------

WRAPPERS = ("warmstart", "stopping", "lr", "energy", "pruning", "robust", "fedsag")
NEEDS_ENERGY = {"energy", "warmstart"}  # a status query to answer (battery, presence)


def _no_plan() -> None:  # full-size replies never need the pruning plan
    raise AssertionError("a standard reply was taken for a pruned submodel")


def build(parts: set[str], store: Path) -> Strategy:
    """The parts nested as EdgeFleet's own ServerApp nests them (outermost first):
    warm start > stopping > learning rate > energy selection > reconstruction > robust rule
    > aggregator (FedSAG, or Flower's FedAvg)."""
    strategy: Strategy
    kw = {"fraction_train": 1.0, "fraction_evaluate": 0.0, **ONE}
    if "fedsag" in parts:
        strategy = FedSAG(robust="median" if "robust" in parts else "off", **kw)  # type: ignore[arg-type]
    else:
        strategy = FedAvg(**kw)  # type: ignore[arg-type]
        if "robust" in parts:
            strategy = RobustAggregation(strategy, "median")
    if "pruning" in parts:
        strategy = SubmodelReconstruction(strategy, _no_plan)  # type: ignore[arg-type]
    if "energy" in parts:
        strategy = EnergyAgeSelection(strategy, max_devices=3, slots_per_round=4)
    if "lr" in parts:
        strategy = SessionLearningRate(strategy, 0.5)
    if "stopping" in parts:
        strategy = TaskVectorStopping(strategy, patience=50)
    if "warmstart" in parts:
        strategy = WarmStartInitializer(
            strategy,
            store=SessionStore(store, 5),
            initial=initial_model(),
            tracker=SessionTracker(change_threshold=0.2, max_rounds=2),
        )
    return strategy


def run(strategy: Strategy, with_energy: bool, rounds: int = ROUNDS):  # type: ignore[no-untyped-def]
    with ClientAppGrid({}, NODES, user_app(with_energy)) as grid:
        return strategy.start(
            grid,  # type: ignore[arg-type]
            initial_model(),
            num_rounds=rounds,
            train_config=ConfigRecord({"lr": 0.5}),
            evaluate_fn=central,
        )


def check_trains(result, rounds: int = ROUNDS) -> None:  # type: ignore[no-untyped-def]
    trained = sorted(result.train_metrics_clientapp)
    assert trained == list(range(1, rounds + 1)), f"rounds with participants: {trained}"
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    assert acc[rounds] > acc[0] + 0.3, acc
    assert acc[rounds] >= max(acc[r] for r in range(1, 3)) - 0.05, acc  # still rising, not lost


PAIRS = [frozenset(p) for p in itertools.combinations(WRAPPERS, 2)]


@pytest.mark.parametrize("parts", PAIRS, ids=lambda p: "+".join(sorted(p)))
def test_every_pair_of_wrappers_trains_in_a_users_app(
    parts: frozenset[str], tmp_path: Path
) -> None:
    result = run(build(set(parts), tmp_path / "store"), bool(parts & NEEDS_ENERGY))
    check_trains(result)


def test_the_full_stack_trains_in_a_users_app(tmp_path: Path) -> None:
    result = run(build(set(WRAPPERS), tmp_path / "store"), True, rounds=6)
    check_trains(result, rounds=6)


def test_warm_start_around_energy_selection_as_the_readme_writes_it(tmp_path: Path) -> None:
    """The own-app table's line, verbatim: the sessions wrapper declares no clock of its own
    (it used to keep slots_per_round=1 beside the selection's 4; the energy mod saw the
    clock go backwards, answered the presence query with an error, and every device counted
    as departed: no participant from round 3 on)."""
    arrays = initial_model()
    strategy = WarmStartInitializer(
        TaskVectorStopping(
            EnergyAgeSelection(
                FedSAG(fraction_evaluate=0.0, **ONE), max_devices=3, slots_per_round=4
            ),  # type: ignore[arg-type]
            patience=50,
        ),
        store=tmp_path / "store",
        initial=arrays,
    )
    check_trains(run(strategy, True, rounds=6), rounds=6)


def test_a_second_run_of_a_users_app_continues_the_warm_start_store(tmp_path: Path) -> None:
    """The store keeps the session a run ends in: a user's second ``start()`` on the same
    folder (a new ServerApp run) opens Session 2, warm-started from the stored model,
    instead of Session 1 again."""
    from edgefleet.loop.context import SessionRow
    from edgefleet.loop.roundloop import RoundCallback, RoundResult

    sessions: list[tuple[int, str]] = []

    class Watch(RoundCallback):
        def after_round(self, result: RoundResult) -> str | None:
            sessions.append((result.session, str(result.context.section(SessionRow).phase)))
            return None

    def one_run() -> None:
        strategy = WarmStartInitializer(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, **ONE),  # type: ignore[arg-type]
            store=tmp_path / "store",
            initial=initial_model(),
        )
        strategy.own_callbacks = lambda: [strategy, Watch()]  # type: ignore[method-assign]
        check_trains(run(strategy, False, rounds=4), rounds=4)

    one_run()
    assert SessionStore.open(tmp_path / "store", 10).last_session() == 1
    one_run()
    assert [s for s, _ in sessions] == [1] * 4 + [2] * 4
    assert sessions[4][1] == "aux"  # from the pilot model the first run stored
    assert SessionStore.open(tmp_path / "store", 10).last_session() == 2
