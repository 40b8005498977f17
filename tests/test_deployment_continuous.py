"""Warm start's Continuous baseline on the Deployment Engine: the teacher travels once per
device and session, and the device keeps it between messages in ``Context.state``.

Real ``flower-superlink`` and two ``flower-supernode`` processes on loopback (each ClientApp
is a fresh process per message, so only the SuperNode's context carries the teacher from one
round to the next). Two groups of one device take turns for two sessions of three rounds;
in the second session the first round that trains carries the teacher and the later ones do
not. A device that had lost it would decline them (``ERR_NO_TEACHER``). Under a load of 20 on
2 cores rounds took about 100 s each (a ClientApp process per message imports torch and
loads its data), and a presence answer could miss the status query's 60 s: a round then has
nobody present, so the checks below do not assume which round opens session 2.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import start_fleet, stopped_after, submit, summary_and_rows, wait_for_summary

NUM_NODES = 2
SESSIONS, ROUNDS = 2, 3
RUN_NAME = "deploy-continuous"
RUN_DEADLINE = 1200.0  # seconds from the start; about 3 minutes on an idle machine


@pytest.mark.timeout(RUN_DEADLINE + 60)
def test_continuous_teacher_kept_by_supernodes_between_rounds(tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir = tmp_path / "out" / RUN_NAME
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-continuous")
    with stopped_after(fleet, tmp_path):
        start_fleet(fleet, NUM_NODES)
        run_config = {
            "num-server-rounds": SESSIONS * ROUNDS,
            "model": "linear",
            "local-steps": 2,
            "min-nodes": NUM_NODES,
            "output-dir": str(tmp_path / "out"),
            "run-name": RUN_NAME,
            "sessions.schedule": "alternate",
            "sessions.count": SESSIONS,
            "sessions.rounds": ROUNDS,
            "warmstart.mode": "continuous",
            "lr-schedule": "session-poly",
        }
        flwr_run = submit(fleet, tmp_path, run_config)
        wait_for_summary(fleet, flwr_run, run_dir / "summary.json", t0 + RUN_DEADLINE)
        _, rows = summary_and_rows(run_dir)
    assert [r["session"] for r in rows[:2]] == [1, 1] and rows[-1]["session"] == 2
    assert all(r["declined"] == [] and len(r["participants"]) <= 1 for r in rows), rows
    trained = [r for r in rows if r["session"] == 2 and r["participants"]]
    assert len(trained) >= 2, rows
    assert [r.get("teacher_downloads", 0) for r in trained] == [1] + [0] * (len(trained) - 1)
    assert trained[0]["bytes_down"] == 2 * trained[1]["bytes_down"]  # model and teacher
    # the per-session decay: session 1's second round trains at a lower rate than its first
    assert rows[0]["lr"] == pytest.approx(0.05) and rows[1]["lr"] < rows[0]["lr"]
