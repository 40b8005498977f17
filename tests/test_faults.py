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
from edgefleet.server.app import build_strategy
from edgefleet.task.train import get_arrays
from tests.fakes import FakeGrid
from tests.test_pruning_fl import _model, _run

ONE_NODE = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0}
WHY = {
    "nan": "non-finite",
    "shape": "want float32",
    "missing-key": "missing",
    "indices": "unknown groups",
    "huge": "want float32",
    "dtype": "got float64",
}


def _device(partition: int, fault: str | None = None):
    node = {"partition-id": partition, "num-partitions": 3}
    if fault:
        node["test-corrupt"] = fault
    ctx = Context(
        run_id=1, node_id=partition + 1, node_config=node, state=RecordDict(),
        run_config={"local-steps": 2, "batch-size": 16},
    )  # fmt: skip
    return lambda msg: train(msg, ctx)


def test_every_kind_of_bad_reply_is_dropped_and_the_run_goes_on() -> None:
    FakeGrid({})
    grid = FakeGrid({1: _device(0), 2: _device(1, "cycle"), 3: _device(2)})
    strategy = build_strategy(parse_run_config({}))  # EdgeFleet's own server stack
    start = get_arrays(_model())
    arrays, results = _run(strategy, grid, start, rounds=len(KINDS))
    for kind, res in zip(KINDS, results, strict=True):
        assert res.participants == ["0", "2"], kind
        assert [r["device"] for r in res.rejected] == ["1"], kind
        assert WHY[kind] in res.rejected[0]["reason"], (kind, res.rejected[0]["reason"])
    for value in to_numpy(arrays).values():
        assert np.isfinite(value).all()


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
