"""EdgeFleet's strategies as a Flower user meets them: record keys, metrics that differ
between replies, ``summary()``, the ``Result`` of ``start()``, and a package that does not
depend on EdgeFleet's apps."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.algorithms.tracker import SessionTracker
from edgefleet.loop.context import ScreeningRow
from edgefleet.strategies import (
    EnergyAgeSelection,
    FedSAG,
    RecordKeys,
    RoundLoop,
    SubmodelReconstruction,
    TaskVectorStopping,
    ValidationStopping,
    WarmStartInitializer,
)
from edgefleet.strategies.warmstart_initializer import SessionStore
from tests.fakes import FakeGrid, no_eval, rec

ROOT = Path(__file__).resolve().parents[1]
ONE = {"min_available_nodes": 1, "min_train_nodes": 1, "min_evaluate_nodes": 1}


def _adds(delta: float, n: int, arrays_in: str = "arrays", **extra: object):
    """A standard Flower client: reads the model from ``arrays_in``, adds ``delta``, replies
    with ArrayRecord ``params`` and MetricRecord ``stats`` (names a strategy never chose)."""

    def handle(msg: Message) -> Message:
        if msg.metadata.message_type == "evaluate":
            metrics = MetricRecord({"acc": 0.25 * n, "num-examples": n})
            return Message(RecordDict({"stats": metrics}), reply_to=msg)
        w = msg.content[arrays_in]["w"].numpy() + delta
        metrics = MetricRecord({"loss": 1.0, "num-examples": n, **extra})  # type: ignore[dict-item]
        return Message(RecordDict({"params": rec(w=w), "stats": metrics}), reply_to=msg)

    return handle


def test_record_keys_follow_the_inner_strategy() -> None:
    inner = FedAvg(arrayrecord_key="weights", weighted_by_key="n", fraction_evaluate=0.0, **ONE)
    assert RecordKeys.of(TaskVectorStopping(inner)) == RecordKeys("weights", "config", "n")

    def client(delta: float, n: int):
        def handle(msg: Message) -> Message:
            w = msg.content["weights"]["w"].numpy() + delta
            metrics = MetricRecord({"n": n})
            return Message(RecordDict({"w": rec(w=w), "m": metrics}), reply_to=msg)

        return handle

    grid = FakeGrid({1: client(1.0, 1), 2: client(4.0, 3)})
    result = TaskVectorStopping(inner, patience=5).start(grid, rec(w=np.zeros(1)), num_rounds=1)  # type: ignore[arg-type]
    np.testing.assert_allclose(result.arrays["w"].numpy(), [(1.0 + 12.0) / 4])


def test_metrics_that_differ_between_replies_are_aggregated_on_the_common_keys() -> None:
    grid = FakeGrid(
        {
            1: _adds(1.0, 1),
            2: _adds(1.0, 1, extra=7.0),  # a key the others lack
            3: _adds(1.0, 2, loss_curve=[1.0, 0.5]),  # a list the others lack
        }
    )
    strategy = TaskVectorStopping(FedAvg(fraction_evaluate=0.0, **ONE), patience=5)
    out = RoundLoop(strategy, grid, evaluate_fn=no_eval).run(rec(w=np.zeros(1)), 2)  # type: ignore[arg-type]
    np.testing.assert_allclose(out.arrays["w"].numpy(), [2.0])  # aggregated, every round


def test_a_weight_that_is_not_a_positive_finite_number_is_dropped() -> None:
    grid = FakeGrid({1: _adds(1.0, 1), 2: _adds(100.0, 1), 3: _adds(100.0, 1)})
    grid.handlers[2] = _adds(100.0, float("inf"))  # type: ignore[arg-type]
    grid.handlers[3] = _adds(100.0, -1)
    loop = RoundLoop(FedAvg(fraction_evaluate=0.0, **ONE), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    assert result.participants == ["node-1"]
    assert sorted(r["device"] for r in result.rejected) == ["node-2", "node-3"]
    assert all("'num-examples'" in r["reason"] for r in result.rejected)


def test_a_submodel_reply_without_reconstruction_is_dropped() -> None:
    def pruned(msg: Message) -> Message:
        reply = _adds(1.0, 1)(msg)
        reply.content["kept"] = rec(conv=np.arange(2))
        return reply

    grid = FakeGrid({1: _adds(1.0, 1), 2: pruned})
    loop = RoundLoop(FedAvg(fraction_evaluate=0.0, **ONE), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    assert result.participants == ["node-1"]
    assert "needs SubmodelReconstruction" in result.rejected[0]["reason"]
    assert set(result.arrays) == {"w"}


def test_an_aggregation_that_raises_drops_the_round_not_the_run() -> None:
    class Broken(FedAvg):
        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            if server_round == 1:
                raise TypeError("boom")
            return super().aggregate_train(server_round, replies)

    grid = FakeGrid({1: _adds(1.0, 1)})
    loop = RoundLoop(Broken(fraction_evaluate=0.0, **ONE), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    first = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    assert (
        "boom" in str(first.context.section(ScreeningRow).round_dropped)
        and first.participants == []
    )
    np.testing.assert_array_equal(first.arrays["w"].numpy(), [0.0])
    second = loop.run_round(2, first.arrays, ConfigRecord(), 0.0)
    np.testing.assert_array_equal(second.arrays["w"].numpy(), [1.0])


def test_a_non_finite_global_model_is_rolled_back() -> None:
    # Finite replies, and an inner strategy whose aggregate overflows. (FedSAG checks its
    # own step; any other strategy's result is checked by the loop.)
    class Overflowing(FedAvg):
        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            arrays, metrics = super().aggregate_train(server_round, replies)
            return rec(w=arrays["w"].numpy() * np.float32(1e38)), metrics

    grid = FakeGrid({1: _adds(10.0, 1), 2: _adds(10.0, 1)})
    strategy = Overflowing(fraction_evaluate=0.0, **ONE)
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.ones(1)), ConfigRecord(), 0.0)
    assert (
        "rolled back" in str(result.context.section(ScreeningRow).round_dropped)
        and result.participants == []
    )
    np.testing.assert_array_equal(result.arrays["w"].numpy(), [1.0])


def test_start_fills_every_field_of_flowers_result() -> None:
    grid = FakeGrid({1: _adds(1.0, 1), 2: _adds(3.0, 1)})
    calls = []

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append(rnd)
        return MetricRecord({"accuracy": float(arrays["w"].numpy()[0])})

    strategy = TaskVectorStopping(FedAvg(fraction_evaluate=1.0, **ONE), patience=5)
    result = strategy.start(grid, rec(w=np.zeros(1)), num_rounds=2, evaluate_fn=central)  # type: ignore[arg-type]
    assert calls == [0, 1, 2]  # the initial model too, as Flower's start() does
    assert result.evaluate_metrics_serverapp[2]["accuracy"] == pytest.approx(4.0)
    assert set(result.train_metrics_clientapp) == {1, 2}
    assert result.train_metrics_clientapp[2]["loss"] == pytest.approx(1.0)
    assert result.evaluate_metrics_clientapp[1]["acc"] == pytest.approx(0.25)
    np.testing.assert_allclose(result.arrays["w"].numpy(), [4.0])


def test_summary_states_each_wrappers_settings_then_the_inner_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = FedSAG(server_lr=0.5, fraction_evaluate=0.0, **ONE)
    strategy = TaskVectorStopping(
        EnergyAgeSelection(SubmodelReconstruction(inner, lambda: None), 7, 4),
        tau=0.01,  # type: ignore[arg-type,return-value]
    )
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.summary()
    text = caplog.text
    order = [
        "TaskVectorStopping settings",
        "tau): 0.01",
        "EnergyAgeSelection settings",
        "(M): 7",
        "SubmodelReconstruction settings",
        "FedSAG settings",
        "Server learning rate: 0.5",
        "Weighted by",  # Flower's FedAvg's own summary
    ]
    positions = [text.index(line) for line in order]
    assert positions == sorted(positions)


def test_validation_and_sessions_summaries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = WarmStartInitializer(
        ValidationStopping(FedAvg(**ONE), lambda a: 0.5, patience=3),
        store=SessionStore(tmp_path / "s", 3),
        tracker=SessionTracker(0.2, 5),
        initial=rec(w=np.zeros(1)),
        param_keys=["w"],
        mode="pilot",
    )
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.INFO, logger="flwr"):
        sessions.summary()
    assert "WarmStartInitializer settings" in caplog.text and "Patience: 3" in caplog.text


def test_a_strategy_waiting_for_absent_nodes_gives_up_and_skips_that_phase() -> None:
    # Flower's defaults want 2 nodes for evaluation; one is online: Flower would wait forever.
    grid = FakeGrid({1: _adds(1.0, 1)})
    strategy = FedAvg(min_available_nodes=1, min_train_nodes=1)
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, node_wait_timeout=1.5)  # type: ignore[arg-type]
    result = loop.run_round(1, rec(w=np.zeros(1)), ConfigRecord(), 0.0)
    assert result.participants == ["node-1"] and result.federated_metrics == {}


def test_the_library_does_not_import_the_apps() -> None:
    """``edgefleet.strategies`` depends on flwr and numpy (and the NumPy parts of pruning),
    never on ``edgefleet.server`` or ``edgefleet.client``, nor on torch."""
    for path in (ROOT / "edgefleet" / "strategies").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                assert not name.startswith(("edgefleet.server", "edgefleet.client")), (path, name)
    code = (
        "import sys, edgefleet.strategies\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch'\n"
        "       or m.startswith(('edgefleet.server', 'edgefleet.client'))]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_an_empty_subset_is_bounded_like_the_grid() -> None:
    """A wrapper that hands its inner FedAvg a subset with fewer nodes than it samples (no
    device present, say) must not hang the server: the loop's bound on waiting applies."""
    from edgefleet.loop.base import SubsetGrid
    from edgefleet.loop.roundloop import BoundedGrid, NotEnoughNodes

    bounded = BoundedGrid(FakeGrid({1: _adds(1.0, 1), 2: _adds(1.0, 1)}), timeout=0.0)  # type: ignore[arg-type]
    subset = SubsetGrid(bounded, [2, 7])  # type: ignore[arg-type]
    assert subset.get_node_ids() == [2]  # node 7 is not online
    with pytest.raises(NotEnoughNodes):
        FedAvg(min_available_nodes=2).configure_train(1, rec(w=np.zeros(1)), ConfigRecord(), subset)  # type: ignore[arg-type]
