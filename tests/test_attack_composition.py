"""Robust aggregation composed with EdgeFleet's wrappers, with attackers present (issue 25's
composition tests), on in-process grids (seconds, no Ray):

- a Flower user's own app (tests/thirdparty): its ServerApp's ``TaskVectorStopping(
  FedTrimmedAvg(...))`` and ``TaskVectorStopping(RobustAggregation(FedAvg(),
  rule="median"))``, its ClientApp with EdgeFleet's sign-flip attack mod on 2 of 10 nodes;
- EdgeFleet's own ServerApp and ClientApp with energy-age selection + FedSAG + CA-HFP pruning
  + ``robust.rule`` + ``attack.kind`` (benchmarks/lib/runs.py's in-process engine).
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from tests.fakes import FakeGrid

ROOT = Path(__file__).resolve().parents[1]
THIRDPARTY = ROOT / "tests" / "thirdparty"
NODES, ROUNDS = 10, 3


@pytest.fixture(scope="module")
def quickstart() -> Any:
    sys.path.insert(0, str(THIRDPARTY))
    try:
        from quickstart_app import client_app, server_app
    finally:
        sys.path.remove(str(THIRDPARTY))
    return client_app, server_app


def _central(result: dict[str, Any]) -> list[float]:
    central = result["central"]
    return [central[str(r)]["accuracy"] for r in range(ROUNDS + 1)]


def test_users_robust_strategies_under_stopping_learn_with_sign_flippers(
    quickstart: Any, tmp_path: Path
) -> None:
    client_app, server_app = quickstart
    assert client_app.ATTACKERS == (0, 1)  # 20 % of the nodes
    defaults = tomllib.loads((THIRDPARTY / "pyproject.toml").read_text())
    run_config = {
        **defaults["tool"]["flwr"]["app"]["config"],
        # "stopping" (plain FedAvg under the same wrapper) is what the attack does undefended.
        "strategies": "stopping,trimmed-stopping,median-stopping",
        "out": str(tmp_path / "result.json"),
        "num-server-rounds": ROUNDS,
        "fraction-evaluate": 0.0,
    }
    contexts = {
        i + 1: Context(
            run_id=1,
            node_id=i + 1,
            node_config={"partition-id": i, "num-partitions": NODES},
            state=RecordDict(),
            run_config=run_config,
        )
        for i in range(NODES)
    }
    app = client_app.app_with_attackers
    grid = FakeGrid({n: (lambda m, c=c: app(m, c)) for n, c in contexts.items()})
    server_app.app(grid, Context(1, 0, {}, RecordDict(), run_config))  # type: ignore[arg-type]
    results = json.loads((tmp_path / "result.json").read_text())

    undefended = _central(results["stopping"])
    for name in ("trimmed-stopping", "median-stopping"):
        acc = _central(results[name])
        # Every round aggregated the replies; the model learnt, and better than FedAvg did
        # with the same two nodes sending their update sign-flipped.
        assert sorted(results[name]["train"]) == [str(r) for r in range(1, ROUNDS + 1)]
        assert acc[0] < 0.2 and acc[-1] > 0.7, (name, acc)
        assert acc[-1] >= undefended[-1] + 0.05, (name, acc, undefended)


def _run_once() -> Any:
    """benchmarks/lib/runs.py's ``run_once`` (the in-process engine's one-run helper)."""
    from benchmarks.lib.runs import run_once

    return run_once


def test_edgefleet_app_energy_fedsag_pruning_median_learns_with_an_attacker(
    tmp_path: Path,
) -> None:
    run_once = _run_once()
    from edgefleet.client.app import attacker_partitions

    devices, seed = 6, 0
    config = {
        "num-server-rounds": ROUNDS,
        "seed": seed,
        "model": "mlp",
        "lr": 0.1,
        "local-steps": 5,
        "eval-samples": 300,
        "min-nodes": devices,
        "strategy": "fedsag",
        "selection.mode": "energy-age",
        "selection.max-devices": 5,
        # Every device can afford every round: who trains is the selection's, not the battery's.
        "energy.capacity": 8.0,
        "energy.harvest-prob": 1.0,
        "pruning.keep-ratios": "1.0,0.5",
        "robust.rule": "median",
        "attack.kind": "sign-flip",
        "attack.fraction": 0.2,
    }
    # The attacker trains the full model (keep ratio 1.0); a pruned attacker is the next test.
    (attacker,) = attacker_partitions(devices, 0.2, seed)
    assert attacker % 2 == 0
    rows = run_once(tmp_path, "composed", {"num-supernodes": devices}, config, 300, "inprocess")

    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert all(r["robust_rule"] == "median" for r in rows)
    assert all(not r["declined"] and not r["rejected"] for r in rows)
    # Energy-age selection: 5 of 6 a round, the attacker among them, pruned replies too.
    assert all(len(r["participants"]) == 5 for r in rows)
    assert any(str(attacker) in r["participants"] for r in rows)
    assert all(r["compact_replies"] >= 1 for r in rows)
    acc = [r["test_accuracy"] for r in rows]
    assert acc[-1] > 0.3 and acc[-1] > acc[0], acc


def test_a_pruned_device_attacks_on_its_kept_channels(tmp_path: Path) -> None:
    # Every device prunes the full model it is sent (keep ratio 0.5, full download); the
    # sign-flip mod takes the attacker's update on its kept channels. Before, it answered
    # such a round with an error: a CA-HFP fleet had no model-side attackers at all.
    run_once = _run_once()
    from edgefleet.client.app import attacker_partitions

    devices, seed = 4, 1
    config = {
        "num-server-rounds": 2, "seed": seed, "model": "mlp", "lr": 0.1, "local-steps": 5,
        "eval-samples": 300, "min-nodes": devices, "pruning.keep-ratio": 0.5,
    }  # fmt: skip
    (attacker,) = attacker_partitions(devices, 0.25, seed)
    fed = {"num-supernodes": devices}
    clean = run_once(tmp_path, "clean", fed, config, 300, "inprocess")
    attacked = run_once(
        tmp_path, "attacked", fed, {**config, "attack.kind": "sign-flip", "attack.fraction": 0.25},
        300, "inprocess",
    )  # fmt: skip
    for rows in (clean, attacked):
        assert all(not r["declined"] and not r["rejected"] for r in rows)
        assert all(len(r["participants"]) == devices for r in rows)
        assert all(r["compact_replies"] == devices for r in rows)  # every reply a submodel
    assert str(attacker) in attacked[0]["participants"]
    # The same seeds and data: only the attacker's flipped update tells the runs apart.
    assert [r["train_loss"] for r in clean] != [r["train_loss"] for r in attacked]
    assert attacked[0]["test_accuracy"] != clean[0]["test_accuracy"]


@pytest.mark.timeout(600)
def test_edgefleet_app_composed_with_an_attacker_on_the_simulation_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one test here on Flower's Simulation Engine (Ray actors, a SuperLink): the same
    composition, and ``attack.*`` accepted there (a deployment run refuses it)."""
    import tempfile

    from edgefleet.client.app import attacker_partitions
    from edgefleet.simulation.runner import Scenario, run_scenario

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    devices, seed = 4, 2
    (attacker,) = attacker_partitions(devices, 0.25, seed)
    assert attacker % 2 == 0  # keeps the full model (keep ratios 1.0, 0.5 alternate)
    config = {
        "num-server-rounds": 2,
        "seed": seed,
        "model": "mlp",
        "lr": 0.1,
        "local-steps": 5,
        "eval-samples": 300,
        "min-nodes": devices,
        "strategy": "fedsag",
        "selection.mode": "energy-age",
        "selection.max-devices": 3,
        "energy.capacity": 8.0,
        "energy.harvest-prob": 1.0,
        "pruning.keep-ratios": "1.0,0.5",
        "robust.rule": "median",
        "attack.kind": "sign-flip",
        "attack.fraction": 0.25,
        "output-dir": str(tmp_path),
        "run-name": "sim",
    }
    federation = {"num-supernodes": devices, "client-resources-num-cpus": 1}
    run_dir = run_scenario(Scenario("sim", federation, config), timeout=480, quiet=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_run"] == 2 and summary["config"]["attack.kind"] == "sign-flip"
    assert all(r["robust_rule"] == "median" and not r["rejected"] for r in rows)
    assert all(len(r["participants"]) == 3 for r in rows)
    assert any(str(attacker) in r["participants"] for r in rows)
    assert all(r["compact_replies"] >= 1 for r in rows)
    assert rows[-1]["test_accuracy"] > 0.2, [r["test_accuracy"] for r in rows]
