"""The warm worker on the Deployment Engine (issue 16): ``edgefleet supernode`` nodes keep
every behaviour that the per-message ``flwr-clientapp`` processes have.

A real SuperLink and four SuperNodes on loopback, three as ``edgefleet supernode`` (a
``flower-supernode --isolation process`` child, EdgeFleet's worker as its executor) and one as
``flower-supernode --isolation process`` with ``edgefleet worker`` beside it; energy-aware
selection, 3 rounds:

- node 0 harvests nothing (a trace of zeros) and holds exactly one round's energy: it trains
  in round 1 and never again. The battery lives in ``Context.state``, which the worker pulls
  from the SuperNode and pushes back with every message; a worker that kept or lost a copy
  of its own would show the device fresh and feasible in later rounds;
- node 1 is a CA-HFP device (``keep-ratio=0.5``): a compact reply every round;
- node 2 lies (``test-corrupt=cycle``, under the ClientApp with the fault mod that the run
  is submitted with): each bad reply is dropped with its reason;
- node 3 asks for an accelerator this machine lacks: it answers every train message with an
  error reply (declined), naming what there is.

Each node ran one worker process for all its messages: one ClientApp load, no
``flwr-clientapp`` process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgefleet.task.accelerator import available_accelerators
from fleetharness.faults import FAULTY_APP, KINDS
from fleetharness.fleet import DeploymentFleet
from tests.flower_runs import stopped_after, submit, summary_and_rows, wait_for_summary
from tests.test_faults import WHY

NUM_ROUNDS = 3
RUN_NAME = "deploy-worker"
STARTUP_TIMEOUT = 120.0
RUN_DEADLINE = 420.0  # s from the test's start; about 1-2 min on 2 idle cores


@pytest.mark.timeout(540)
def test_warm_workers_keep_batteries_pruning_and_error_replies(tmp_path: Path) -> None:
    t0 = time.monotonic()
    dark = tmp_path / "dark.txt"
    dark.write_text("0\n")
    nodes: list[dict[str, int | float | str]] = [
        {"energy-source": "trace", "trace-path": str(dark), "capacity": 4.0},
        {"energy-source": "always-on", "keep-ratio": 0.5},
        {"energy-source": "always-on", "test-corrupt": "cycle"},
        {"energy-source": "always-on", "accelerator": "cuda"},
    ]
    fleet = DeploymentFleet(tmp_path / "flower", connection="deploy-worker")
    with stopped_after(fleet, tmp_path):
        fleet.start_superlink(timeout=STARTUP_TIMEOUT)
        executors = []
        for i, extra in enumerate(nodes):
            node = {"partition-id": i, "num-partitions": len(nodes), **extra}
            if i != 1:
                executors.append(fleet.start_supernode(node, warm=True))
                continue
            # Node 1 the other way: flower-supernode --isolation process + `edgefleet worker`.
            sn = fleet.start_supernode(node, ["--isolation", "process"])
            port = sn.args[sn.args.index("--port") + 1]
            executors.append(
                fleet.start(
                    "worker-1",
                    [
                        "edgefleet",
                        "worker",
                        "--runtime-api-address",
                        f"127.0.0.1:{port}",
                        "--parent-pid",
                        str(sn.pid),
                    ],
                )
            )
        run_dir = tmp_path / "out" / RUN_NAME
        flwr_run = submit(
            fleet,
            tmp_path,
            {
                "num-server-rounds": NUM_ROUNDS,
                "local-steps": 2,
                "min-nodes": len(nodes),
                "node-wait-timeout": STARTUP_TIMEOUT,
                "output-dir": str(tmp_path / "out"),
                "run-name": RUN_NAME,
                "eval-samples": 100,
                "selection.mode": "energy-age",
                "selection.max-devices": len(nodes),
                "energy.train-slots": 3,  # a round costs 4 units: node 0's whole battery
            },
            FAULTY_APP,  # node 2's test-corrupt: EdgeFleet's own ClientApp never lies
        )
        wait_for_summary(fleet, flwr_run, run_dir / "summary.json", t0 + RUN_DEADLINE)
        summary, rows = summary_and_rows(run_dir)
        logs = [p.log_path.read_text(errors="replace") for p in executors]
        plain = sn.log_path.read_text(errors="replace")  # node 1's SuperNode

    assert summary["rounds_run"] == NUM_ROUNDS
    cuda_here = "cuda" in available_accelerators()
    for row, kind in zip(rows, KINDS, strict=False):
        want = ["0", "1"] if row["round"] == 1 else ["1"]
        if cuda_here:
            want = sorted([*want, "3"])
        assert sorted(row["participants"]) == want, row
        assert [r["device"] for r in row["rejected"]] == ["2"], row
        assert WHY[kind] in row["rejected"][0]["reason"], (kind, row["rejected"])
        assert row["compact_replies"] == 1, row
        assert len(row["declined"]) == (0 if cuda_here else 1), row
    for i, text in enumerate(logs):  # one ClientApp load per node, no per-message process
        assert text.count("Worker: loaded the ClientApp") == 1, f"node {i}"
    assert "Start `flwr-clientapp` process" not in "".join([*logs, plain])
    if not cuda_here:
        assert "accelerator 'cuda' requested but this machine has none" in fleet.report(400)
