"""Whole-round wall time of energy-aware age-based selection as the fleet grows.

Runs the same federated job on Flower's Simulation Engine at K = 100 and K = 1,000 devices
with at most M = 25 trained per round (same local work per round: M devices x local steps),
once with batched status queries (devices asked in descending age, ``--query-batch`` at a
time, until M feasible ones answered) and once asking every device each round
(``selection.batch-size = 0``), the naive rule whose cost grows with the fleet, and once
with no selection at all: Flower's own random sampling of M devices (``fraction-train`` =
M / K, no status queries), the engine's floor. Reported per run: the median round wall
time over rounds 2.. (round 1 builds the devices and asks every node once for its device
id), status messages per round, and the K = 1,000 / K = 100 ratio of each mode. Target: the
batched ratio within 1.3.

The Simulation Engine's own cost grows with K: its dispatcher thread scans the message
store once per node every 0.1 s (``vce_api.add_messages_to_queue`` calling
``InMemoryLinkState.get_message_ins`` for each of the K nodes), so the ``flower`` mode's
ratio is the part of the growth that no selection rule can remove; ``selection_s`` is each
mode's round time minus the engine floor at the same K.

The runs are one sweep (``benchmarks/lib/grid.py``): one engine for all of them, finished runs
reused from ``--out``, an interrupted one resumed. With several ``--seeds`` the figures are
the mean over them.

    python -m benchmarks.perf.selection_scaling                      # mnist, 8 rounds: ~15 min
    python -m benchmarks.perf.selection_scaling --fleets 20,200 --dataset mnist-5k --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.lib.grid import add_common_args, emit, run_grid
from benchmarks.lib.overrides import add_key_args, key_values
from edgefleet.simulation.sweep import Point

MODES = ("batched", "all", "flower")


def round_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    walls = [r["wall_s"] for r in rows]
    per_round = [b - a for a, b in zip(walls, walls[1:], strict=False)]  # rounds 2..R
    return {
        "round_s_median": statistics.median(per_round),
        "round_1_s": walls[0],
        # rounds 2..: round 1 asks every node once for its device id
        "status_queries_per_round": statistics.fmean(r.get("status_queries", 0) for r in rows[1:]),
        "status_queries_round_1": rows[0].get("status_queries", 0),
        "participants_per_round": statistics.fmean(len(r["participants"]) for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p, out="bench-selection", local_steps=5, seeds="0")
    p.add_argument("--fleets", default="100,1000", help="small,large K (replaces --devices)")
    p.add_argument("--max-devices", type=int, default=25)
    p.add_argument("--query-batch", type=int, default=40)
    p.add_argument("--rounds", type=int, default=8)
    add_key_args(p, {"batch-size": 10, "dataset": "mnist"})
    p.add_argument("--harvest-prob", type=float, default=0.5)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    key_values(p, args, ["local-steps", "lr", "model", "data-dir", "batch-size", "dataset"])
    small, large = (int(k) for k in args.fleets.split(","))
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        p.error(f"unknown --modes {unknown}; choose from {', '.join(MODES)}")
    points = []
    for mode in modes:
        for k in (small, large):
            overrides: dict[str, Any] = {
                "federation.num-supernodes": k,
                "min-nodes": k,
                "selection.batch-size": args.query_batch if mode == "batched" else 0,
            }
            if mode == "flower":  # Flower's FedAvg samples M nodes itself: the engine floor
                overrides.update({"selection.mode": "all", "fraction-train": args.max_devices / k})
            points.append(Point(f"{mode}-k{k}", overrides))
    run_config = {
        "num-server-rounds": args.rounds,
        "dataset": args.dataset,
        "partition": "iid",
        "batch-size": args.batch_size,
        "selection.mode": "energy-age",
        "selection.max-devices": args.max_devices,
        "energy.harvest-prob": args.harvest_prob,
    }
    rows = run_grid(args, points, run_config, name="selection-scaling")
    results: dict[str, dict[str, float]] = {}
    for point in points:
        per_seed = [round_figures(r) for (name, _), r in rows.items() if name == point.name]
        results[point.name] = {
            key: round(statistics.fmean(f[key] for f in per_seed), 3) for key in per_seed[0]
        }
    ratios = {
        mode: round(
            results[f"{mode}-k{large}"]["round_s_median"]
            / results[f"{mode}-k{small}"]["round_s_median"],
            3,
        )
        for mode in modes
    }
    if "flower" in modes:
        for key, figures in results.items():
            floor = results[f"flower-k{key.rsplit('-k', 1)[1]}"]["round_s_median"]
            figures["selection_s"] = round(figures["round_s_median"] - floor, 3)
    emit(
        "selection_scaling",
        args,
        {"runs": results, "large_over_small": ratios, "target_batched_ratio": 1.3},
        sizes=("fleets", "max_devices", "query_batch", "rounds", "batch_size", "dataset")
        + ("harvest_prob",),
    )


if __name__ == "__main__":
    main()
