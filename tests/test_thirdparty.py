"""EdgeFleet's strategies in a Flower user's own app (tests/thirdparty), on the Simulation
Engine: a ClientApp written like Flower's quickstart (standard replies: arrays plus
``train_loss``/``num-examples``), a ServerApp that only swaps its strategy line.

One ServerApp run starts each strategy in turn from the same model, Flower's own
``FedAvg.start`` first; the test reads what every ``start()`` returned.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgefleet.processes import BIN_DIR, config_arg
from fleetharness.fleet import DeploymentFleet

APP = Path(__file__).resolve().parent / "thirdparty"
ROUNDS = 3
WRAPPERS = ["stopping", "validation", "fedsag", "pruning", "energy"]


def _run(tmp_path: Path, strategies: list[str], clientapp: str) -> tuple[dict[str, Any], str]:
    app = shutil.copytree(APP, tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text().replace(
        'clientapp = "quickstart_app.client_app:app"',
        f'clientapp = "quickstart_app.client_app:{clientapp}"',
    )
    pyproject.write_text(text)
    out = tmp_path / "result.json"
    with DeploymentFleet(tmp_path / "fleet", connection="thirdparty") as fleet:
        fleet.start_superlink(simulation=True)
        cmd = [
            str(BIN_DIR / "flwr"),
            "run",
            str(app),
            fleet.connection,
            "--stream",
            "--run-config",
            config_arg({"strategies": ",".join(strategies), "out": str(out)}),
            "--federation-config",
            config_arg({"num-supernodes": 6, "client-resources-num-cpus": 1}),
        ]
        try:  # inside the test's own limit, so that a hung run still shows its log
            proc = subprocess.run(
                cmd, env=fleet.env, capture_output=True, text=True, timeout=540, check=False
            )
        except subprocess.TimeoutExpired as err:
            log = (err.stdout or b"").decode() + (err.stderr or b"").decode()
            pytest.fail(f"the app did not finish within 540 s:\n{log[-6000:]}")
        log = proc.stdout + proc.stderr
        (tmp_path / "flwr-run.log").write_text(log)
        if not out.exists():
            pytest.fail(f"the app wrote no result (flwr exit {proc.returncode}):\n{log[-4000:]}")
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def with_energy_mod(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return _run(tmp_path_factory.mktemp("tp"), ["fedavg", *WRAPPERS], "app_with_energy")


def _last(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    return metrics[str(max(int(r) for r in metrics))]


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrapper_learns_and_fills_result_like_fedavg(
    with_energy_mod: tuple[dict[str, Any], str], name: str
) -> None:
    results, _ = with_energy_mod
    fedavg, got = results["fedavg"], results[name]
    # Replies were aggregated every round and the model learnt.
    assert sorted(got["train"]) == [str(r) for r in range(1, ROUNDS + 1)]
    assert got["central"]["0"]["accuracy"] < 0.2
    assert _last(got["central"])["accuracy"] > 0.6
    # The Result has every field Flower's own start() fills, with the same metric names.
    assert sorted(got["central"]) == sorted(fedavg["central"])  # round 0 and every round
    assert sorted(got["federated"]) == sorted(fedavg["federated"])
    extra = {"energy-spent"} if name == "energy" else set()
    assert set(_last(got["train"])) == set(_last(fedavg["train"])) | extra
    assert (
        set(_last(got["federated"]))
        == set(_last(fedavg["federated"]))
        == {
            "eval_loss",
            "eval_acc",
        }
    )


@pytest.mark.parametrize("name", ["stopping", "validation", "pruning"])
def test_pass_through_wrappers_equal_flowers_own_fedavg(
    with_energy_mod: tuple[dict[str, Any], str], name: str
) -> None:
    """Wrappers that do not change the aggregation end with Flower's FedAvg's model."""
    results, _ = with_energy_mod
    for ours, flowers in zip(results[name]["arrays"], results["fedavg"]["arrays"], strict=True):
        np.testing.assert_allclose(np.array(ours), np.array(flowers), rtol=1e-5, atol=1e-6)


def test_energy_mod_answers_status_and_charges_the_round(
    with_energy_mod: tuple[dict[str, Any], str],
) -> None:
    results, log = with_energy_mod
    assert "cannot answer EdgeFleet's status query" not in log
    assert re.search(r"energy-age selection: 3 of 6 nodes selected", log)
    # Each participant paid Omega + 1 = 4 units (the mean over participants is 4).
    assert _last(results["energy"]["train"])["energy-spent"] == pytest.approx(4.0)


def test_without_the_mod_energy_selection_says_so_and_falls_back(tmp_path: Path) -> None:
    results, log = _run(tmp_path, ["energy"], "app")
    # Said once, clearly; every node taken as feasible; M = 3 of 6 still trained and learnt.
    assert log.count("cannot answer EdgeFleet's status query") == 1, log[-6000:]
    assert "energy-age selection: 3 of 6 nodes selected" in log
    got = results["energy"]
    assert sorted(got["train"]) == [str(r) for r in range(1, ROUNDS + 1)], log[-6000:]
    assert _last(got["central"])["accuracy"] > 0.5


def test_warm_start_in_a_users_app_opens_its_store_on_a_second_start(tmp_path: Path) -> None:
    """``WarmStartInitializer(FedAvg(), store=FOLDER, initial=...)`` in a user's ServerApp,
    started twice on one folder: the second start opens the store the first left (it used
    to fail on the store's index), continues its sessions and learns."""
    # The quickstart ClientApp without EdgeFleet's mod: every online node is present. (With
    # the battery mod, a second start() in one Flower run restarts the slot clock that the
    # nodes' batteries, kept per run, have passed: they decline; a new `flwr run` does not.)
    results, log = _run(tmp_path, ["warmstart", "warmstart-again"], "app")
    # the first start stored both its sessions (the second one when the run ended)
    assert "holds sessions up to 2 from an earlier run" in log, log[-6000:]
    for name in ("warmstart", "warmstart-again"):
        got = results[name]
        assert sorted(got["train"]) == [str(r) for r in range(1, ROUNDS + 1)], log[-6000:]
        assert sorted(got["central"]) == [str(r) for r in range(ROUNDS + 1)]
        assert _last(got["central"])["accuracy"] > 0.5
