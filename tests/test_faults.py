"""Lying devices: every kind of bad train reply is dropped with its reason, the run goes on
with the honest devices (issue 3). EdgeFleet's ClientApp with the test-only fault mod
(``fleetharness.faults``); EdgeFleet's own ClientApp never lies."""

from __future__ import annotations

import importlib
import tomllib

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from edgefleet.arrays import to_numpy
from edgefleet.client.app import app as production_app
from edgefleet.client.app import train
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.context import ScreeningRow
from edgefleet.loop.roundloop import RoundCallback, RoundLoop, RoundResult
from edgefleet.server.app import build_strategy, screening_for
from edgefleet.simulation.runner import app_copy
from edgefleet.task.train import get_arrays
from fleetharness import faults
from fleetharness.faults import (
    FAULTS_ENV,
    FAULTY_APP,
    KINDS,
    corrupt,
    fault_mod,
    faults_env,
    faulty_clientapp,
    parse_faults_env,
)
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


LIARS = faulty_clientapp()  # lies where a node config says test-corrupt=KIND


def _device(partition: int, fault: str | None = None, app: ClientApp = LIARS):
    """Node ``partition + 1`` running ``app`` (by default the ClientApp with the fault mod);
    ``fault``: its node config's ``test-corrupt``."""
    node = {"partition-id": partition, "num-partitions": 3}
    if fault:
        node["test-corrupt"] = fault
    ctx = Context(
        run_id=1, node_id=partition + 1, node_config=node, state=RecordDict(),
        run_config={"local-steps": 2, "batch-size": 16},
    )  # fmt: skip
    return lambda msg: app(msg, ctx)


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


def test_fault_mod_makes_the_listed_partitions_lie() -> None:
    """In simulation a node's config holds only its partition: fault_mod(kind, partitions)
    makes partition 1 lie without a node config."""
    FakeGrid({})
    app = faulty_clientapp("bad-energy", [1])
    grid = FakeGrid({i + 1: _device(i, app=app) for i in range(3)})
    _, results = _edgefleet_run(grid, rounds=1)
    assert results[0].participants == ["0", "2"]
    assert "'energy-spent'" in results[0].rejected[0]["reason"]


def test_edgefleets_own_clientapp_never_lies() -> None:
    """Neither a node config's test-corrupt nor the run config can make EdgeFleet's
    production ClientApp spoil a reply: the run config has no fault keys at all."""
    FakeGrid({})
    grid = FakeGrid({i + 1: _device(i, "nan", app=production_app) for i in range(3)})
    _, results = _edgefleet_run(grid, rounds=1)
    assert results[0].participants == ["0", "1", "2"] and results[0].rejected == []
    for key in ("test.corrupt", "test.corrupt-partitions"):
        with pytest.raises(ConfigError, match=f"unknown run-config key '{key}'"):
            parse_run_config({key: "1"})


def test_faulty_app_takes_its_partitions_from_the_environment(monkeypatch) -> None:
    """``faulty_app`` (what a Flower engine loads by FAULTY_APP) reads
    EDGEFLEET_TEST_FAULTS when its module is imported; a copy of the app names it."""
    monkeypatch.setenv(FAULTS_ENV, faults_env("nan", [0, 2]))
    try:
        importlib.reload(faults)
        FakeGrid({})
        grid = FakeGrid({i + 1: _device(i, app=faults.faulty_app) for i in range(3)})
        _, results = _edgefleet_run(grid, rounds=1)
    finally:
        monkeypatch.delenv(FAULTS_ENV)
        importlib.reload(faults)
    assert results[0].participants == ["1"]
    assert all("non-finite" in r["reason"] for r in results[0].rejected)


def test_app_copy_names_the_faulty_clientapp(tmp_path) -> None:
    pyproject = app_copy(tmp_path / "app", FAULTY_APP) / "pyproject.toml"
    components = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["components"]
    assert components["clientapp"] == FAULTY_APP
    module, attr = FAULTY_APP.split(":")
    assert isinstance(getattr(importlib.import_module(module), attr), ClientApp)


@pytest.mark.parametrize(
    ("kind", "partitions", "problem"),
    [
        ("nan", [], "give both a kind and the partitions"),
        ("", [1], "give both a kind and the partitions"),
        ("gremlins", [1], "valid choices: cycle, nan"),
    ],
)
def test_bad_fault_mod_settings_are_refused(kind, partitions, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        fault_mod(kind, partitions)


def test_faults_env_round_trips_and_bad_values_are_named() -> None:
    assert faults_env("cycle", [2, 5]) == "cycle:2,5"
    assert parse_faults_env("cycle:2,5") == ("cycle", (2, 5))
    assert parse_faults_env("") == ("", ())
    for bad in ("nan", "nan:", "nan:x", ":1"):
        with pytest.raises(ValueError, match=FAULTS_ENV):
            parse_faults_env(bad)


def test_unknown_fault_kind_is_an_error_reply() -> None:
    FakeGrid({})
    grid = FakeGrid({1: _device(0, "gremlins")})
    _, results = _run(FedAvg(**ONE_NODE), grid, get_arrays(_model()))
    assert results[0].declined == ["node-1"]


@pytest.mark.parametrize("slow", ["abc", "inf", "nan", "-1", "1e9"])
def test_a_bad_slow_node_config_is_an_error_reply(slow: str) -> None:
    node = {"partition-id": 0, "num-partitions": 3, "test-slow-s": slow}
    ctx = Context(
        run_id=1, node_id=1, node_config=node, state=RecordDict(),
        run_config={"local-steps": 2, "batch-size": 16},
    )  # fmt: skip
    grid = FakeGrid({1: lambda msg: LIARS(msg, ctx)})
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
