"""``aggregation.mode = "async"`` through EdgeFleet's own apps on the in-process engine
(benchmarks/_runs.py's one-run helper, as `edgefleet run --engine inprocess` runs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_edgefleet_app_runs_async_versions(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _runs import run_once
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
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
