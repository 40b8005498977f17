"""Shared by the tests that drive real Flower processes: submit the app, wait for its summary."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from edgefleet.processes import FlowerProcess, config_arg
from edgefleet.server.results import read_rows
from edgefleet.simulation.runner import app_copy
from fleetharness.fleet import DeploymentFleet

SUMMARY_GRACE = 30.0  # seconds a run may take to write its summary after the stream ended
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def deploy_module(name: str) -> ModuleType:
    """``deploy/NAME.py`` (a script folder, not a package), imported once under ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def stopped_after(fleet: DeploymentFleet, workdir: Path) -> Iterator[DeploymentFleet]:
    """Run a test body against ``fleet``: print every process's log if it fails, stop the
    fleet whatever happened, and fail if a Flower process outlived it."""
    try:
        yield fleet
    except BaseException:
        print(f"\n----- Flower process logs ({workdir}) -----\n{fleet.report()}")
        raise
    finally:
        fleet.stop()
    assert fleet.survivors() == [], "Flower processes outlived the test"


def start_fleet(fleet: DeploymentFleet, num_nodes: int) -> list[FlowerProcess]:
    """A SuperLink and ``num_nodes`` SuperNodes (node i holds partition i of ``num_nodes``),
    all connected."""
    fleet.start_superlink(timeout=60.0)
    nodes = [
        fleet.start_supernode({"partition-id": i, "num-partitions": num_nodes})
        for i in range(num_nodes)
    ]
    fleet.wait_for_nodes(num_nodes, timeout=60.0)
    return nodes


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` written so far ([] before the first round)."""
    return read_rows(path) if path.exists() else []


def submit(
    fleet: DeploymentFleet,
    workdir: Path,
    run_config: Mapping[str, Any],
    clientapp: str | None = None,
) -> FlowerProcess:
    """``flwr run <a copy of the app> <connection> --stream --run-config ...``, at once;
    ``clientapp``: another ClientApp component (``fleetharness.faults.FAULTY_APP``)."""
    return fleet.flwr(
        "run",
        str(app_copy(workdir / "app", clientapp)),
        fleet.connection,
        "--stream",
        "--run-config",
        config_arg(run_config),
        name="flwr-run",
    )


def wait_for_summary(
    fleet: DeploymentFleet,
    flwr_run: FlowerProcess,
    path: Path,
    deadline: float,
    on_poll: Callable[[], None] = lambda: None,
) -> None:
    """Until the ServerApp writes ``path``; fail on a dead SuperLink, a failed ``flwr run``,
    a stream that ended without the summary, or ``deadline`` (a ``time.monotonic()`` value).
    ``on_poll`` runs twice a second (to kill a node mid-run, say)."""
    stream_ended: float | None = None
    while not path.exists():
        for proc in fleet.processes:
            if proc.name == "superlink" and not proc.running():
                pytest.fail(f"the SuperLink exited:\n{proc.tail()}")
        rc = flwr_run.popen.poll()
        if rc not in (None, 0):
            pytest.fail(f"`flwr run` exited with code {rc}:\n{flwr_run.tail()}")
        if rc == 0 and stream_ended is None:
            stream_ended = time.monotonic()
        if stream_ended is not None and time.monotonic() - stream_ended > SUMMARY_GRACE:
            pytest.fail(f"the run ended without {path}:\n{flwr_run.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path} by the test's deadline")
        on_poll()
        time.sleep(0.5)


def summary_and_rows(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished run's ``summary.json`` and its ``metrics.jsonl`` rows."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, metrics_rows(run_dir / "metrics.jsonl")
