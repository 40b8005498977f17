"""``aggregation.mode = "async"`` through EdgeFleet's own apps on the in-process engine
(benchmarks/lib/runs.py's one-run helper, as `edgefleet run --engine inprocess` runs it)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _runs():  # type: ignore[no-untyped-def]
    """benchmarks/lib/runs.py (the in-process engine's run helpers)."""
    from benchmarks.lib import runs

    return runs


def test_edgefleet_app_runs_async_versions(tmp_path: Path) -> None:
    run_once = _runs().run_once
    devices, versions = 4, 4
    config = {
        "num-server-rounds": versions,
        "seed": 0,
        "model": "mlp",
        "lr": 0.1,
        "local-steps": 5,
        "eval-samples": 300,
        "min-nodes": devices,
        "aggregation.mode": "async",
        "async.concurrency": 3,
        "async.buffer-size": 2,
        "robust.rule": "median",
    }
    rows = run_once(tmp_path, "async", {"num-supernodes": devices}, config, 300, "inprocess")
    assert [r["version"] for r in rows] == list(range(1, versions + 1))
    assert all(r["accepted"] == 2 and len(r["participants"]) == 2 for r in rows)
    assert all(r["robust_rule"] == "median" for r in rows)
    assert all(r["staleness_max"] is not None and r["in_flight"] <= 3 for r in rows)
    # The fourth device gets a slot as the others finish: every device trains.
    assert {p for r in rows for p in r["participants"]} == {"0", "1", "2", "3"}
    acc = [r["test_accuracy"] for r in rows]
    assert acc[-1] > 0.3 and acc[-1] > acc[0], acc
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["aggregation"] == "async" and summary["versions"] == versions
    from edgefleet.simulation.story import story

    told = story(tmp_path / "async")
    assert "Asynchronous aggregation (FedBuff): 4 versions of 2 updates" in told
    # The dashboard and its Prometheus exposition read the run folder as they read a
    # synchronous one; its rounds API carries the asynchronous columns.
    from starlette.testclient import TestClient

    from edgefleet.dashboard.app import create_app

    web = TestClient(create_app(tmp_path / "async"), base_url="http://127.0.0.1:8050")
    served = web.get("/api/rounds").json()
    assert [r["staleness_max"] for r in served] == [r["staleness_max"] for r in rows]
    assert all("in_flight" in r for r in served)
    assert web.get("/metrics").status_code == web.get("/").status_code == 200


def test_an_async_run_resumes_from_its_last_version(tmp_path: Path) -> None:
    """A run that died after version 2 (no summary) resumes at version 3 from the
    checkpoint's model, keeps its rows, and checkpoints every version; data-free stopping
    measures every version's task vector."""
    from edgefleet.server.checkpoint import FILENAME, load_checkpoint

    run_once = _runs().run_once
    config = {
        "seed": 1,
        "model": "mlp",
        "local-steps": 3,
        "eval-samples": 200,
        "min-nodes": 3,
        "aggregation.mode": "async",
        "async.concurrency": 2,
        "async.buffer-size": 2,
        "stopping.mode": "data-free",  # its state (theta_0, the plateau counter) resumes too
        # who starts is chosen by battery and age; the slot clock resumes with the run
        "selection.mode": "energy-age",
        "energy.capacity": 8.0,
        # a device's join version (its participation interval) is in the checkpoint too
        "async.participation": "interval",
    }
    fed = {"num-supernodes": 3}
    run_once(tmp_path, "r", fed, {**config, "num-server-rounds": 2}, 300, "inprocess")
    run_dir = tmp_path / "r"
    saved = load_checkpoint(run_dir / FILENAME)
    assert saved.round == 2
    # A version's checkpoint: its buffer is empty (aggregated), its devices in flight named
    # (none here: the in-process grid answers every message of a pull at once).
    assert saved.loop["buffer"]["entries"] == [] and saved.loop["version"] == 2
    assert saved.loop["in_flight"] == []
    before = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    devices = saved.loop["registry"]["devices"]
    took_part = {d for r in before for d in r["participants"]}
    assert took_part and {d: devices[d].get("joined") for d in took_part} == dict.fromkeys(
        took_part, 0
    )  # every node was connected at version 0
    (run_dir / "summary.json").unlink()  # as if the ServerApp had died after version 2
    more = {**config, "num-server-rounds": 4, "resume": True,
            "resume-changes": "num-server-rounds"}  # fmt: skip
    # (run_once starts an unfinished run afresh; resume it with the engine itself)
    from edgefleet.simulation.runner import Scenario

    _runs().run_inprocess(
        Scenario("r", fed, {**more, "output-dir": str(tmp_path), "run-name": "r"}),
        tmp_path / "r-resumed.log",
        300,
    )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert load_checkpoint(run_dir / FILENAME).round == 4
    assert rows[:2] == before  # the versions on record are kept, not run again
    assert all(r["task_vector_norm"] > 0 for r in rows)
    # Every update paid for its round (energy.train-slots 3 + 1), nobody was sent a model
    # they could not pay for, and the clock (4 slots a version at least) never went back.
    assert all(r["energy_spent"] == 4.0 * len(r["participants"]) for r in rows), rows
    assert not any(r["declined"] for r in rows)
    slots = [r["slot"] for r in rows]
    assert slots == sorted(slots) and slots[-1] >= 4 * 3, slots
    assert all(r["status_queries"] > 0 and r["selected"] for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["rounds_run"] == 4
    after = load_checkpoint(run_dir / FILENAME).loop["registry"]["devices"]
    assert all(after[d]["joined"] == 0 for d in took_part)  # kept across the resume


def test_async_rebuilds_each_submodel_against_the_version_it_was_cut_from(
    tmp_path: Path,
) -> None:
    """CA-HFP in async mode: half the devices prune to half their parameters; a compact reply
    is made full size against the version it was cut from (its pruned entries carry no
    update) before its staleness-weighted rebase, and the rows count it as a submodel."""
    run_once = _runs().run_once
    devices, versions = 4, 6
    config = {
        "num-server-rounds": versions,
        "seed": 0,
        "model": "smallcnn",
        "lr": 0.05,
        "local-steps": 4,
        "eval-samples": 300,
        "min-nodes": devices,
        "aggregation.mode": "async",
        "async.concurrency": 4,
        "async.buffer-size": 2,
        "pruning.keep-ratios": "1.0,0.5",
        "pruning.score-batches": 1,
        # stacked with the robust rule, which reconstruction hands each submodel's mask
        "robust.rule": "median",
    }
    rows = run_once(tmp_path, "cahfp", {"num-supernodes": devices}, config, 300, "inprocess")
    assert [r["version"] for r in rows] == list(range(1, versions + 1))
    assert all(r["accepted"] == 2 for r in rows)
    # Devices 1 and 3 keep half the model: their replies are compact, and some versions
    # are made of stale ones (the staleness a rebase against the newest version weighs).
    assert sum(r["compact_replies"] for r in rows) >= 2
    assert any(r["mean_kept_fraction"] < 1.0 for r in rows)
    assert any(r["staleness_max"] > 0 for r in rows)
    assert not any(r["rejected"] for r in rows)
    acc = [r["test_accuracy"] for r in rows]
    assert acc[-1] > acc[0], acc
