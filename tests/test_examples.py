"""The apps under examples/, run the way their users run them: ``flwr run .`` from a copy of
the example, on Flower's Simulation Engine, at a tiny size (two SuperNodes, a few rounds).

One local SuperLink serves the three runs (its Ray start-up is paid once); each run copies
the example into a temp dir, sets the example's own run config keys with ``--run-config``,
and reads what its ServerApp wrote (``results``, a JSON file of per-round figures).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgefleet.processes import BIN_DIR, config_arg
from fleetharness.fleet import DeploymentFleet

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_TIMEOUT = 300  # seconds; each took 30-135 s on a loaded 2-core machine (the first most)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeploymentFleet]:
    with DeploymentFleet(tmp_path_factory.mktemp("examples"), connection="examples") as fleet:
        # One Ray cluster for the three runs: each run would otherwise start (and pay for) its own.
        fleet.start_ray_head(num_cpus=2)
        fleet.start_superlink(simulation=True)
        yield fleet


def run_example(
    fleet: DeploymentFleet, name: str, run_config: dict[str, Any], nodes: int = 2
) -> tuple[dict[str, Any], str]:
    """``flwr run . <connection>`` in a copy of ``examples/<name>``; (results, log)."""
    app = shutil.copytree(
        EXAMPLES / name,
        fleet.workdir / name,
        ignore=shutil.ignore_patterns("__pycache__", "*.pt", "results*.json"),
    )
    out = fleet.workdir / f"{name}-results.json"
    cmd = [
        str(BIN_DIR / "flwr"),
        "run",
        ".",
        fleet.connection,
        "--stream",
        "--run-config",
        config_arg({**run_config, "results": str(out)}),
        "--federation-config",
        config_arg({"num-supernodes": nodes, "client-resources-num-cpus": 1}),
    ]
    start = time.monotonic()
    try:  # inside the test's own limit, so that a hung run still shows its log
        proc = subprocess.run(
            cmd, cwd=app, env=fleet.env, capture_output=True, text=True, timeout=RUN_TIMEOUT
        )
    except subprocess.TimeoutExpired as err:
        log = (err.stdout or b"").decode() + (err.stderr or b"").decode()
        pytest.fail(f"{name} did not finish within {RUN_TIMEOUT} s:\n{log[-6000:]}")
    log = proc.stdout + proc.stderr
    print(f"{name}: {time.monotonic() - start:.1f} s")
    (fleet.workdir / f"{name}.log").write_text(log)
    if not out.exists():
        pytest.fail(f"{name} wrote no results (flwr exit {proc.returncode}):\n{log[-6000:]}")
    return json.loads(out.read_text()), log


def accuracy(results: dict[str, Any], round: int) -> float:
    return float(results[str(round)]["central"]["accuracy"])


def test_energy_aware_fedsag(fleet: DeploymentFleet) -> None:
    results, log = run_example(fleet, "energy-fedsag", {"num-server-rounds": 3, "max-devices": 1})
    assert sorted(results, key=int) == ["0", "1", "2", "3"], log[-4000:]
    assert "energy-age selection: 1 of 2 nodes selected" in log, log[-4000:]
    trained = [r for r in ("1", "2", "3") if results[r]["train"]]
    assert trained, log[-4000:]
    # Each round's participant paid for it from its battery: Omega + 1 = 4 units.
    assert all(results[r]["train"]["energy-spent"] == pytest.approx(4.0) for r in trained)
    assert accuracy(results, 3) > accuracy(results, 0) + 0.2


def test_pruning_on_the_devices(fleet: DeploymentFleet) -> None:
    results, log = run_example(
        fleet, "pruning-cahfp", {"num-server-rounds": 3, "keep-ratios": "1.0,0.5"}
    )
    assert sorted(results, key=int) == ["0", "1", "2", "3"], log[-4000:]
    # Both replies were aggregated every round: the pruned one rebuilt, not dropped.
    assert "dropped" not in log, log[-4000:]
    for r in ("1", "2", "3"):
        # The mean over a full device (1.0) and one that trained about half the parameters.
        share = results[r]["train"]["parameter-share"]
        assert 0.7 < share < 0.8, (r, share)
    assert accuracy(results, 3) > accuracy(results, 0) + 0.2


def test_sessions_warm_start_and_stopping(fleet: DeploymentFleet) -> None:
    store = fleet.workdir / "sessions-store"
    results, log = run_example(
        fleet,
        "sessions-stopping",
        {
            "num-server-rounds": 5,
            "session-store": str(store),
            "away-from": 3,  # device 1 is away in rounds 3 and 4: sessions 1, 2, 3
            "away-until": 5,
            # Any growth counts as a plateau (early growth is 100-200 % a round): the rule
            # fires at the session's second round, within this tiny run.
            "tau": 10.0,
            "patience": 1,
        },
    )
    assert sorted(results, key=int) == [str(r) for r in range(6)], log[-4000:]
    assert "Session 2 opens at round 3 (membership)" in log, log[-6000:]
    assert "Session 3 opens at round 5 (membership)" in log, log[-6000:]
    assert "Warm start weights over stored sessions" in log, log[-6000:]
    growth = r"Round 2: task vector growth [0-9.e+-]+ \(tau 10\), plateau 1/1"
    assert re.search(growth, log), log[-6000:]
    assert "Round 2: task vector plateau; resting until the next session" in log, log[-6000:]
    assert accuracy(results, 5) > accuracy(results, 0) + 0.2


def test_a_misspelled_key_is_refused_by_flowers_superlink_which_names_it(
    fleet: DeploymentFleet,
) -> None:
    """Flower checks ``--run-config`` keys against the app's table before the ServerApp
    starts: ``flwr run`` prints only ``Invalid run configuration.``; the SuperLink's log
    names the key (what docs/tutorials/own-flower-app.md tells users to look for)."""
    app = fleet.workdir / "misspelled"
    shutil.copytree(EXAMPLES / "energy-fedsag", app, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [str(BIN_DIR / "flwr"), "run", ".", fleet.connection, "--run-config",
         "num-server-round=3"],
        cwd=app, env=fleet.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Invalid run configuration" in proc.stdout + proc.stderr
    assert "num-server-round" not in proc.stdout + proc.stderr  # Flower does not say which
    superlink = (fleet.workdir / "superlink.log").read_text()
    assert "Key 'num-server-round' is not present in the main dictionary" in superlink
