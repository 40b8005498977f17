"""Lying devices: every kind of bad train reply is dropped with its reason, the run goes on
with the honest devices (issue 3). The real ClientApp with its test-only fault switch."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.arrays import to_numpy
from edgefleet.client.app import train
from edgefleet.client.faults import KINDS, corrupt
from edgefleet.config import parse_run_config
from edgefleet.server.app import build_strategy, screening_for
from edgefleet.strategies.context import ScreeningRow
from edgefleet.strategies.loop import RoundCallback, RoundLoop, RoundResult
from edgefleet.task.train import get_arrays
from tests.fakes import FakeGrid, no_eval
from tests.test_pruning_fl import _model, _run

ONE_NODE = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0}
WHY = {
    "nan": "non-finite",
    "shape": "want float32",
    "missing-key": "missing",
    "indices": "unknown groups",
    "huge": "want float32",
    "dtype": "got float64",
    "inf-examples": "'num-examples' must be a positive finite number",
    "huge-examples": "above the round's bound",
    "scaled": "update norm",
    "noise": "update norm",
    # Device 1 (node 2, never bound: all its replies so far were rejected) claims device 0's
    # id, which earlier rounds bound to node 1.
    "spoof-id": "device-id 0 is bound to node 1, still online",
    "bad-metrics": None,  # usable: the odd metrics are left out of the average
    "bad-energy": "'energy-spent' must be a finite number",
}


def _device(partition: int, fault: str | None = None, **run_config: object):
    node = {"partition-id": partition, "num-partitions": 3}
    if fault:
        node["test-corrupt"] = fault
    ctx = Context(
        run_id=1, node_id=partition + 1, node_config=node, state=RecordDict(),
        run_config={"local-steps": 2, "batch-size": 16, **run_config},
    )  # fmt: skip
    return lambda msg: train(msg, ctx)


def _edgefleet_run(grid: FakeGrid, rounds: int, **run_config: object):
    """EdgeFleet's own server stack and screening bounds, from the run config."""
    cfg = parse_run_config({"local-steps": 2, "batch-size": 16, **run_config})
    strategy = build_strategy(cfg)
    results: list[RoundResult] = []

    class Keep(RoundCallback):
        def after_round(self, result: RoundResult) -> str | None:
            results.append(result)
            return None

    callbacks = [*strategy.round_callbacks(), Keep()]  # type: ignore[attr-defined]
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=callbacks,  # type: ignore[arg-type]
                     screening=screening_for(cfg))  # fmt: skip
    return loop.run(get_arrays(_model()), rounds).arrays, results


def test_every_kind_of_bad_reply_is_dropped_and_the_run_goes_on() -> None:
    FakeGrid({})
    grid = FakeGrid({1: _device(0), 2: _device(1, "cycle"), 3: _device(2)})
    arrays, results = _edgefleet_run(grid, rounds=len(KINDS))
    for kind, res in zip(KINDS, results, strict=True):
        assert res.context.section(ScreeningRow).round_dropped is None, (kind, res.extra)
        why = WHY[kind]
        if why is None:
            assert res.participants == ["0", "1", "2"] and res.rejected == [], kind
            continue
        assert res.participants == ["0", "2"], kind
        liar = "node-2" if kind == "spoof-id" else "1"  # a refused claim: known by its node
        assert [r["device"] for r in res.rejected] == [liar], kind
        assert all(why in r["reason"] for r in res.rejected), (kind, res.rejected)
    for value in to_numpy(arrays).values():
        assert np.isfinite(value).all()


def test_run_config_makes_simulated_partitions_lie() -> None:
    """In simulation a node's config holds only its partition: test.corrupt and
    test.corrupt-partitions make partition 1 lie without a node config."""
    FakeGrid({})
    lies = {"test.corrupt": "bad-energy", "test.corrupt-partitions": "1"}
    grid = FakeGrid({i + 1: _device(i, **lies) for i in range(3)})
    _, results = _edgefleet_run(grid, rounds=1, **lies)
    assert results[0].participants == ["0", "2"]
    assert "'energy-spent'" in results[0].rejected[0]["reason"]


def test_unknown_fault_kind_is_an_error_reply() -> None:
    FakeGrid({})
    grid = FakeGrid({1: _device(0, "gremlins")})
    _, results = _run(FedAvg(**ONE_NODE), grid, get_arrays(_model()))
    assert results[0].declined == ["node-1"]


def test_bad_fault_kind_names_the_choices() -> None:
    with pytest.raises(ValueError, match="valid choices: cycle, nan"):
        corrupt(RecordDict(), "bogus", 1)


def test_unreadable_data_path_is_an_error_reply_not_a_crash(tmp_path) -> None:
    FakeGrid({})
    ctx = Context(
        run_id=1, node_id=1, state=RecordDict(), run_config={},
        node_config={"partition-id": 0, "num-partitions": 1,
                     "data-path": str(tmp_path / "missing.npz")},
    )  # fmt: skip
    grid = FakeGrid({1: lambda msg: train(msg, ctx)})
    _, results = _run(FedAvg(**ONE_NODE), grid, get_arrays(_model()))
    assert results[0].declined == ["node-1"] and results[0].participants == []
