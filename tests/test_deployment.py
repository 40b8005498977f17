"""Deployment smoke test: the same app runs under Flower's Deployment Engine.

A real ``flower-superlink`` (not ``--simulation``) and three ``flower-supernode`` processes on
loopback, each in its own session, with a private ``FLWR_HOME``; ``flwr run <project>
<connection> --stream`` submits the app (built into a FAB from the project folder) and the
ServerApp must write a two-round ``summary.json`` with all three nodes in every round.
Everything started here is stopped by process group (and by an inherited environment tag,
which also reaches the SuperLink's ``flower-superexec``, started in a session of its own),
and the test checks that nothing outlives it.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest

from fleetharness.faults import FAULTY_APP, KINDS
from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import SUMMARY_GRACE, submit, summary_and_rows, wait_for_summary
from tests.test_faults import WHY

NUM_NODES = 3  # honest ones
LIAR = str(NUM_NODES)  # the fourth node's device id (its partition id)
NUM_ROUNDS = 2
RUN_NAME = "deploy-smoke"
# Seconds, from the test's start. Two rounds take about 30-60 s on an idle 2-core machine
# (each ClientApp is a fresh process that imports torch); under load, more.
STARTUP_TIMEOUT = 60.0
RUN_DEADLINE = 240.0


@pytest.mark.timeout(300)
def test_two_rounds_on_deployment_engine(tmp_path: Path) -> None:
    t0 = time.monotonic()
    output_dir = tmp_path / "out"
    run_dir = output_dir / RUN_NAME
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-smoke")
    try:
        fleet.start_superlink(timeout=STARTUP_TIMEOUT)
        for i in range(NUM_NODES + 1):
            node: dict[str, int | float | str] = {
                "partition-id": i,
                "num-partitions": NUM_NODES + 1,
            }
            if i == NUM_NODES - 1:  # a weak device: CA-HFP's resource class from its own config
                node["keep-ratio"] = 0.5
            if i == NUM_NODES:
                node["test-corrupt"] = "cycle"
            fleet.start_supernode(node)
        fleet.wait_for_nodes(NUM_NODES + 1, timeout=STARTUP_TIMEOUT)
        t_nodes = time.monotonic() - t0
        run_config = {
            "num-server-rounds": NUM_ROUNDS,
            "local-steps": 5,
            "min-nodes": NUM_NODES + 1,
            "output-dir": str(output_dir),
            "run-name": RUN_NAME,
            # The data-free rule runs in deployment too (a patience the run cannot reach).
            "stopping.mode": "data-free",
            "stopping.patience": 100,
        }
        # The fourth node's test-corrupt needs the ClientApp with the fault mod: EdgeFleet's
        # own never lies.
        flwr_run = submit(fleet, tmp_path, run_config, FAULTY_APP)
        # `--stream` may return before or after the ServerApp writes the summary; a run that
        # failed ends the stream without one.
        summary_path = run_dir / "summary.json"
        wait_for_summary(fleet, flwr_run, summary_path, t0 + RUN_DEADLINE)
        t_summary = time.monotonic() - t0

        summary, rows = summary_and_rows(run_dir)
        assert summary["rounds_run"] == NUM_ROUNDS
        assert [row["round"] for row in rows] == list(range(1, NUM_ROUNDS + 1))
        for kind, row in zip(KINDS, rows, strict=False):
            assert sorted(row["participants"]) == [str(i) for i in range(NUM_NODES)], row
            assert row["declined"] == [], row
            assert [r["device"] for r in row["rejected"]] == [LIAR], row
            assert WHY[kind] in row["rejected"][0]["reason"], (kind, row["rejected"])
            assert row["compact_replies"] == 1 and row["mean_kept_fraction"] < 0.9, row
            acc = row["test_accuracy"]
            assert isinstance(acc, float) and math.isfinite(acc) and 0.0 <= acc <= 1.0, row
        assert summary["final_accuracy"] == rows[-1]["test_accuracy"]
        assert rows[0]["task_vector_growth"] is None
        assert isinstance(rows[1]["task_vector_growth"], float)

        # The stream ends with the run; a CLI still attached long after is a failure too.
        try:
            rc = flwr_run.popen.wait(timeout=SUMMARY_GRACE)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"`flwr run --stream` still running {SUMMARY_GRACE:.0f} s after the summary"
            )
        assert rc == 0, flwr_run.tail()
        print(
            f"\n{NUM_NODES + 1} nodes online after {t_nodes:.1f} s, summary after {t_summary:.1f} s"
        )
    except BaseException:
        print(f"\n----- Flower process logs ({tmp_path}) -----\n{fleet.report()}")
        raise
    finally:
        t_stop = time.monotonic()
        fleet.stop()
        now = time.monotonic()
        print(f"fleet stopped in {now - t_stop:.1f} s; test took {now - t0:.1f} s")
    assert fleet.survivors() == [], "Flower processes outlived the test"
