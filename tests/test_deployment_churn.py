"""A device dies mid-run on the Deployment Engine: the round in flight finishes with the rest
within the round timeout, the server opens a new session (the present set changed), warm
start runs its auxiliary round there, and the run completes (issues 3 and 7).

Real ``flower-superlink`` and three ``flower-supernode`` processes on loopback; one SuperNode
(with its ClientApps) is killed with SIGKILL after round 1 is on record.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import metrics_rows, start_fleet, stopped_after, submit, wait_for_summary

NUM_NODES = 3
NUM_ROUNDS = 4
ROUND_TIMEOUT = 60.0
RUN_NAME = "deploy-churn"
RUN_DEADLINE = 600.0  # seconds from the start; about 3 minutes on an idle 2-core machine


@pytest.mark.timeout(RUN_DEADLINE + 60)
def test_killed_supernode_ends_a_session_and_the_run_goes_on(tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir = tmp_path / "out" / RUN_NAME
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-churn")
    with stopped_after(fleet, tmp_path):
        nodes = start_fleet(fleet, NUM_NODES)
        run_config = {
            "num-server-rounds": NUM_ROUNDS,
            "local-steps": 3,
            "min-nodes": NUM_NODES,
            "round-timeout": ROUND_TIMEOUT,
            "output-dir": str(tmp_path / "out"),
            "run-name": RUN_NAME,
            "warmstart.mode": "pilot",  # sessions on, detected from who is present
            "warmstart.pilot-sessions": 1,
            "sessions.change-threshold": 0.2,  # one of three gone: a Jaccard distance of 1/3
        }
        flwr_run = submit(fleet, tmp_path, run_config)
        metrics = run_dir / "metrics.jsonl"
        killed_at: list[float] = []

        def kill_after_round_1() -> None:
            if not killed_at and len(metrics_rows(metrics)) >= 1:
                os.killpg(nodes[-1].pid, signal.SIGKILL)  # the SuperNode and its ClientApps
                killed_at.append(time.monotonic())

        wait_for_summary(
            fleet, flwr_run, run_dir / "summary.json", t0 + RUN_DEADLINE, kill_after_round_1
        )
        rows = metrics_rows(metrics)
        assert [r["round"] for r in rows] == list(range(1, NUM_ROUNDS + 1))
        assert all(r["rejected"] == [] for r in rows)
        assert len(rows[0]["participants"]) == NUM_NODES
        gone = str(NUM_NODES - 1)  # device id = partition id
        after = [r for r in rows if r["session"] == 2]
        assert after, f"no second session: {[(r['round'], r['session']) for r in rows]}"
        assert after[0]["left"] == [gone] and after[0]["phase"] == "aux"
        assert after[-1]["round"] == NUM_ROUNDS
        for row in after:
            assert gone not in row["participants"] and len(row["participants"]) == NUM_NODES - 1
        # No round waited for the dead node much longer than the round timeout.
        walls = [0.0] + [r["wall_s"] for r in rows]
        assert max(b - a for a, b in zip(walls, walls[1:], strict=False)) < 3 * ROUND_TIMEOUT
        print(f"\nkilled after round 1 at {killed_at[0] - t0:.0f} s; rounds: {walls[1:]}")
