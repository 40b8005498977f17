"""The ServerApp dies mid-run on the Deployment Engine and the run is resumed (issue 3).

Real ``flower-superlink`` and two ``flower-supernode`` processes on loopback. Once round 2 is
checkpointed, the ``flwr-serverapp`` process is killed with SIGKILL (the SuperLink and the
SuperNodes live on, as after a crash of the server's app). ``flwr run`` with
``resume=true`` and the same run name then continues from the last checkpoint: every round
appears exactly once in ``metrics.jsonl``, the rounds before the checkpoint are the killed
run's rows unchanged, and the run completes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from edgefleet.server.checkpoint import FILENAME, CheckpointError, load_checkpoint
from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import metrics_rows, start_fleet, stopped_after, submit, wait_for_summary

NUM_NODES = 2
NUM_ROUNDS = 4
KILL_AFTER = 2  # rounds on record
RUN_NAME = "deploy-resume"
RUN_DEADLINE = 480.0  # seconds from the start; about 2 minutes on an idle 2-core machine


def _checkpointed(run_dir: Path) -> int:
    """The last round in the checkpoint (written after the round's metrics row); 0 if none."""
    try:
        return load_checkpoint(run_dir / FILENAME).round
    except CheckpointError:  # not written yet (a half-written one is never visible)
        return 0


def _serverapps(fleet: DeploymentFleet) -> list[int]:
    return [p.pid for p in fleet.members() if "flwr-serverapp" in p.cmd]


@pytest.mark.timeout(RUN_DEADLINE + 60)
def test_killed_serverapp_resumes_with_no_round_lost_or_repeated(tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_dir = tmp_path / "out" / RUN_NAME
    metrics = run_dir / "metrics.jsonl"
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-resume")
    with stopped_after(fleet, tmp_path):
        start_fleet(fleet, NUM_NODES)
        run_config = {
            "num-server-rounds": NUM_ROUNDS,
            "local-steps": 3,
            "min-nodes": NUM_NODES,
            "round-timeout": 60.0,
            "output-dir": str(tmp_path / "out"),
            "run-name": RUN_NAME,
        }
        first = submit(fleet, tmp_path, run_config)
        while _checkpointed(run_dir) < KILL_AFTER:
            fleet.check_alive()
            if first.popen.poll() is not None:
                pytest.fail(f"`flwr run` ended before round {KILL_AFTER}:\n{first.tail()}")
            if time.monotonic() > t0 + RUN_DEADLINE:
                pytest.fail(f"round {KILL_AFTER} not on record by the deadline")
            time.sleep(0.2)
        pids = _serverapps(fleet)
        assert pids, "no flwr-serverapp process to kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        first.popen.kill()  # its log stream would wait for a run that no longer moves
        assert not (run_dir / "summary.json").exists(), "the run finished before the kill"
        done = load_checkpoint(run_dir / FILENAME).round
        assert KILL_AFTER <= done < NUM_ROUNDS
        before = metrics_rows(metrics)[:done]

        (tmp_path / "again").mkdir()
        resumed = submit(fleet, tmp_path / "again", {**run_config, "resume": True})
        wait_for_summary(fleet, resumed, run_dir / "summary.json", t0 + RUN_DEADLINE)
        rows = metrics_rows(metrics)
        assert [r["round"] for r in rows] == list(range(1, NUM_ROUNDS + 1))
        assert rows[:done] == before  # not run again
        # The SuperNodes may still be pulling the killed run's messages (the SuperLink
        # answers "Run is finished" until they give up) when the resumed run's first round
        # starts; that round can then time out empty. Later rounds train.
        seen = [(r["round"], r["participants"], r["declined"], r["rejected"]) for r in rows]
        assert any(r["participants"] for r in rows[done:]), seen
        print(f"\nrounds (participants, declined, rejected): {seen}")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds_run"] == NUM_ROUNDS
        print(f"\nkilled after round {done}; resumed run done at {time.monotonic() - t0:.0f} s")
