"""EdgeFleet on a Ray cluster that already runs (``edgefleet run --ray-address``), issue 18.

A real two-node cluster on this machine: a head (``ray start --head``) and a second node
(``ray start --address``), each with its own temp dir, free ports and one CPU. A run of two
simulated devices, one CPU each, must place its two actors on the two nodes (read from Ray's
GCS, which the state API serves) and write the same rows as the same seed run on a cluster
of its own. Skipped, with Ray's reason, where the second node cannot start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgefleet.processes import FleetError, FlowerFleet
from edgefleet.simulation.runner import load_scenario, run_scenario

ROOT = Path(__file__).resolve().parents[1]
STARTED = "Ray runtime started"
TIMING = {"wall_s"}

# The actors of every job the cluster ran, from the GCS (dead ones stay listed).
ACTORS = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
actors = [(a["ActorClassName"], a["Address"]["NodeID"]) for a in state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.timeout(900)
def test_a_run_spreads_over_an_existing_two_node_cluster(tmp_path: Path) -> None:
    overrides = {
        "federation.num-supernodes": 2,
        "federation.client-resources-num-cpus": 1,
        "num-server-rounds": 3,
        "local-steps": 5,
        "output-dir": str(tmp_path),
    }
    scenario = ROOT / "scenarios" / "fedavg.toml"
    with FlowerFleet(tmp_path / "cluster") as cluster:
        try:
            address = cluster.start_ray_head(num_cpus=1, timeout=300)
            head = next(p for p in cluster.processes if p.name == "ray-head")
            cluster.wait_for_log(head, STARTED, timeout=300)
            node = cluster.start_ray_node(address, num_cpus=1)
            cluster.wait_for_log(node, STARTED, timeout=300)
        except FleetError as err:
            pytest.skip(f"Ray could not start a two-node cluster here: {err}")
        run_dir = run_scenario(
            load_scenario(scenario, {**overrides, "run-name": "two-nodes"}),
            timeout=600,
            quiet=True,
            ray_address=address,
        )
        out = subprocess.run(
            [sys.executable, "-c", ACTORS, address],
            capture_output=True,
            text=True,
            timeout=300,
            env=cluster.env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        placed = json.loads(out.stdout.strip().splitlines()[-1])
    nodes = {n for n, alive in placed["nodes"].items() if alive}
    actor_nodes = {n for cls, n in placed["actors"] if cls == "ClientAppActor"}
    assert len(nodes) == 2, placed
    assert actor_nodes == nodes, f"the run's actors ran on {actor_nodes}, the cluster is {nodes}"
    assert cluster.survivors() == []
    single = run_scenario(
        load_scenario(scenario, {**overrides, "run-name": "one-node"}), timeout=600, quiet=True
    )
    assert _rows(run_dir) == _rows(single)
    assert all(sorted(r["participants"]) == ["0", "1"] for r in _rows(run_dir))
