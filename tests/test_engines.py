"""The in-process engine gives the rows Flower's Simulation Engine gives.

First what a node sees on the in-process grid (as on Flower's engine: its own Context, a
copy of the message, Flower's error reply when its ClientApp raises, with its state left as
it was); then the engines side by side.

One seeded scenario with every technique that keeps state between rounds (sessions with a
pilot warm start and its weighting, energy-age selection on batteries, FedSAG's memory,
CA-HFP submodels, data-free stopping) runs on Flower's Simulation Engine (Ray), then on
the in-process engine with 1 worker (every message in the ServerApp's process) and with 2
(each device starting in a worker process, moved where a round falls unevenly). Every column
of every row must be equal, floats to within 1e-6 relative (``_equal``: one CI run saw a loss
differ in its 7th digit), the loss and the norms included: both engines train a device with
the same seed, one torch thread and its own state, and the server aggregates in device order, so
nothing may depend on the engine, the order replies arrive in or the process a device
trained in. Only wall-clock times differ; and ``fleet.json``'s node ids, which Flower draws
at random.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from edgefleet import cli
from edgefleet.simulation.inprocess import (
    ClientAppGrid,
    InProcessEngine,
    InProcessGrid,
    WorkerPool,
)
from edgefleet.simulation.runner import Scenario, load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[1]


def _counting_app() -> ClientApp:
    """A ClientApp that counts its calls in its node's state, writes into the message it
    got, and raises when the config says ``fail``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        held = context.state.config_records.get("calls", ConfigRecord({"n": 0}))
        calls = int(held["n"]) + 1  # type: ignore[arg-type]
        context.state["calls"] = ConfigRecord({"n": calls})
        config = msg.content.config_records["config"]
        if config.get("fail"):
            raise RuntimeError("boom")
        config["touched"] = True
        part = int(context.node_config["partition-id"])  # type: ignore[arg-type]
        metrics = MetricRecord({"calls": calls, "partition": part})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _train(node: int, **config: bool) -> Message:
    return Message(RecordDict({"config": ConfigRecord(dict(config))}), node, "train")


def test_a_node_keeps_its_state_gets_a_copy_and_a_raising_app_changes_nothing() -> None:
    grid = ClientAppGrid({}, 2, app=_counting_app())
    assert grid.get_node_ids() == [1, 2]
    sent = [_train(2), _train(1), _train(1)]
    replies = grid.send_and_receive(sent)
    # In the order sent, each answering its own message, each node counting its own calls.
    assert [r.metadata.reply_to_message_id for r in replies] == [
        m.metadata.message_id for m in sent
    ]
    got = [(r.content["metrics"]["partition"], r.content["metrics"]["calls"]) for r in replies]
    assert got == [(1, 1), (0, 1), (0, 2)]
    assert "touched" not in sent[0].content["config"]  # the app wrote into its own copy
    (error,) = grid.send_and_receive([_train(1, fail=True)])
    assert error.has_error() and error.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert error.error.reason.startswith(
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'"
    ) and error.error.reason.endswith("boom'>")  # Flower's engine's words
    (after,) = grid.send_and_receive([_train(1)])
    assert after.content["metrics"]["calls"] == 3  # the failed call's count was not kept


def test_a_pool_balances_a_delivery_and_a_moved_node_keeps_its_state() -> None:
    # Nodes 1 and 4 start in worker 0 of 3 (node i in worker (i - 1) mod 3).
    with ClientAppGrid({}, 6, app=_counting_app, workers=3) as grid:
        pool = grid._pool
        assert pool is not None and pool.pin[1] == pool.pin[4] == 0
        sent = [_train(1), _train(4), _train(1), _train(4)]
        replies = grid.send_and_receive(sent)
        assert [r.metadata.reply_to_message_id for r in replies] == [
            m.metadata.message_id for m in sent
        ]
        got = [(r.content["metrics"]["partition"], r.content["metrics"]["calls"]) for r in replies]
        assert got == [(0, 1), (3, 1), (0, 2), (3, 2)]  # each node's messages in their order
        assert (pool.pin[1], pool.pin[4]) == (0, 1)  # the busiest worker's last node moved
        (again,) = grid.send_and_receive([_train(4)])
        assert again.content["metrics"]["calls"] == 3  # its Context moved with it


def test_balance_moves_whole_nodes_until_shares_differ_by_at_most_one() -> None:
    pool = WorkerPool.__new__(WorkerPool)  # the balancing alone: no processes
    pool.conns = [None, None, None]  # type: ignore[list-item]
    pool.pin = {n: 0 for n in range(1, 8)} | {8: 2}
    by_node = {n: [(n, _train(n))] for n in range(1, 9)}
    moves = pool.balance(by_node)
    loads = [sum(pool.pin[n] == w for n in by_node) for w in range(3)]
    assert loads == [3, 3, 2] and moves == {7: 0, 6: 0, 5: 0, 4: 0}
    # A node with two messages moves whole, and only where it narrows the gap.
    pool.pin = {1: 0, 2: 0}
    assert pool.balance({1: [(0, _train(1))] * 2, 2: [(1, _train(2))] * 2}) == {2: 0}
    assert pool.pin == {1: 0, 2: 1}


def test_a_message_to_a_node_that_is_not_there_gets_no_reply() -> None:
    grid = InProcessGrid({1: lambda m: Message(RecordDict(), reply_to=m)})
    replies = grid.send_and_receive([_train(1), _train(7)])
    assert [r.metadata.src_node_id for r in replies] == [1]


def test_options_of_the_other_engine_are_refused_before_any_work(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "_early_engine", lambda *a: None)  # no Ray cluster for this
    scenario = str(ROOT / "scenarios" / "default.toml")
    assert cli.main(["run", scenario, "--workers", "2"]) == 2
    assert "add --engine inprocess" in capsys.readouterr().err
    assert cli.main(["run", scenario, "--engine", "inprocess", "--ray-address", "h:1"]) == 2
    assert "--ray-address runs the ClientApps on a Ray cluster" in capsys.readouterr().err
    assert cli.main(["sweep", scenario, "--engine", "inprocess", "--workers", "0"]) == 2
    assert "--workers 0: must be at least 1" in capsys.readouterr().err


# make demo's scenario (scenarios/default.toml), small: 6 devices in two groups of 3, three
# sessions of 3 rounds (a pilot, then two warm starts: the second one weighs session 2's
# model), 2 of the 3 present devices a round, 1 local step; tau 0.9 rests a session's devices
# after its second round.
OVERRIDES: dict[str, Any] = {
    "federation.num-supernodes": 6,
    "num-server-rounds": 9,
    "sessions.count": 3,
    "sessions.rounds": 3,
    "warmstart.pilot-sessions": 1,
    "selection.max-devices": 2,
    "local-steps": 1,
    "batch-size": 16,
    "eval-samples": 200,
    "stopping.tau": 0.9,
    "stopping.patience": 1,
}
TIMES = ("wall_s", "written_at")  # wall-clock, the only columns an engine may change
MACHINE_STATE = ("load-1m", "mem-free-mb", "cpu-temp-c")  # device telemetry of the moment


def _scenario(out: Path, name: str) -> Scenario:
    return load_scenario(
        ROOT / "scenarios" / "default.toml",
        {**OVERRIDES, "output-dir": str(out), "run-name": name},
    )


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMES} for x in lines]


def _fleet(run_dir: Path) -> dict[str, Any]:
    fleet = json.loads((run_dir / "fleet.json").read_text())
    for device in fleet["devices"]:
        device.pop("node")  # Flower's node ids are random numbers; the in-process ones 1..N
        device.pop("link")  # each round's timing on this machine's clock
        for key in MACHINE_STATE:  # readings of the machine at that moment, not the run's
            device.get("telemetry", {}).pop(key, None)
    return {k: v for k, v in fleet.items() if k not in TIMES}


def _model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoint.npz", allow_pickle=False) as ckpt:
        keys = sorted((k for k in ckpt if re.fullmatch(r"m\d+", k)), key=lambda k: int(k[1:]))
        return [ckpt[k] for k in keys]


def _equal(a: object, b: object) -> bool:
    """Equal, a float to its last bits: one CI run read round 1's test_loss as
    2.3135097503662108 on one engine and 2.3135095977783204 on the other (cause not found;
    it passed on the same machine before and after). Every other column is exact."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def _same(name: str, got: Path, want: Path) -> None:
    rows, expected = _rows(got), _rows(want)
    assert [r["round"] for r in rows] == [r["round"] for r in expected], name
    for row, exp in zip(rows, expected, strict=True):
        diff = {
            k: (row.get(k), exp.get(k))
            for k in row.keys() | exp.keys()
            if not _equal(row.get(k), exp.get(k))
        }
        assert not diff, f"{name}, round {exp['round']}: (in-process, Flower) differ: {diff}"
    assert _fleet(got) == _fleet(want), f"{name}: fleet.json differs"
    model, flower_model = _model(got), _model(want)
    assert len(model) == len(flower_model)
    assert all(np.array_equal(a, b) for a, b in zip(model, flower_model, strict=True)), (
        f"{name}: the final model differs"
    )


@pytest.mark.timeout(600)
def test_inprocess_engine_rows_equal_the_simulation_engines(tmp_path: Path) -> None:
    flower = run_scenario(_scenario(tmp_path, "flower"), timeout=480, quiet=True)
    rows = _rows(flower)
    # The scenario does what it is here for, or the comparison proves little.
    assert any(r.get("phase") == "aux" for r in rows), "no warm start"
    assert any(r.get("warmstart_weights") for r in rows), "no session model weighed"
    assert any(r.get("compact_replies") for r in rows), "no CA-HFP submodel"
    assert any(r.get("plateau_count") for r in rows), "data-free stopping never counted"
    assert any(len(r.get("selected", [])) < r.get("present", 0) for r in rows), "no selection"
    for workers in (1, 2):
        with InProcessEngine(workers=workers) as engine:
            run_dir = engine.run(_scenario(tmp_path, f"inprocess-{workers}"), timeout=300)
        assert f"{workers} worker process(es)" in (run_dir / "flower.log").read_text()
        _same(f"workers={workers}", run_dir, flower)
