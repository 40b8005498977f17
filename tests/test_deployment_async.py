"""Asynchronous aggregation on Flower's Deployment Engine, with one straggler (issue 45).

A real ``flower-superlink`` and three ``flower-supernode`` processes on loopback; node 2
holds every train reply back ``SLOW_S`` seconds (``test-slow-s``, fleetharness's fault mod),
at least 10 times a fast node's reply here (a fresh ClientApp process that imports torch and
trains: 3-12 s, more under load). ``aggregation.mode = "async"`` with a buffer of 2 must make
its versions from the two fast nodes' replies as they come, never waiting for the straggler:
a synchronous round would take ``SLOW_S`` each.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleetharness.faults import FAULTY_APP, SLOW_KEY
from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import submit, summary_and_rows, wait_for_summary

NODES = 3
SLOW = "2"  # the straggler's device id (its partition id)
SLOW_S = 300.0  # far beyond any fast reply on a loaded machine; the test never waits it out
VERSIONS = 3
RUN_NAME = "deploy-async"
STARTUP_TIMEOUT = 60.0


@pytest.mark.timeout(SLOW_S + 2 * STARTUP_TIMEOUT + 60)  # past its own waits, which fail first
def test_async_versions_come_at_the_fast_nodes_pace(tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir = tmp_path / "out" / RUN_NAME
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-async")
    try:
        fleet.start_superlink(timeout=STARTUP_TIMEOUT)
        for i in range(NODES):
            node: dict[str, int | float | str] = {"partition-id": i, "num-partitions": NODES}
            if str(i) == SLOW:
                node[SLOW_KEY] = SLOW_S
            fleet.start_supernode(node)
        fleet.wait_for_nodes(NODES, timeout=STARTUP_TIMEOUT)
        run_config = {
            "num-server-rounds": VERSIONS,
            "local-steps": 3,
            "eval-samples": 300,
            "min-nodes": NODES,
            "output-dir": str(tmp_path / "out"),
            "run-name": RUN_NAME,
            "aggregation.mode": "async",
            "async.concurrency": NODES,
            "async.buffer-size": 2,
            "round-timeout": SLOW_S * 2,  # the straggler is slow, not gone
        }
        started = time.monotonic()
        flwr_run = submit(fleet, tmp_path, run_config, FAULTY_APP)
        # The straggler's first reply would come SLOW_S after the run started: the summary
        # must come well before it.
        wait_for_summary(fleet, flwr_run, run_dir / "summary.json", started + SLOW_S - 10)
        summary, rows = summary_and_rows(run_dir)
        assert summary["aggregation"] == "async" and summary["versions"] == VERSIONS, summary
        assert [r["version"] for r in rows] == list(range(1, VERSIONS + 1)), rows
        for row in rows:
            assert row["accepted"] == 2 and SLOW not in row["participants"], row
            assert row["in_flight"] >= 1, row  # the straggler, still training
        assert {p for r in rows for p in r["participants"]} == {"0", "1"}, rows
        took = time.monotonic() - started
        print(f"\n{VERSIONS} versions in {took:.1f} s (the straggler's reply: {SLOW_S} s)")
    except BaseException:
        print(f"\n----- Flower process logs ({tmp_path}) -----\n{fleet.report()}")
        raise
    finally:
        fleet.stop()
        print(f"test took {time.monotonic() - t0:.1f} s")
    assert fleet.survivors() == [], "Flower processes outlived the test"
