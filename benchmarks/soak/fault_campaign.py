"""Hostile devices against the server's screening: does every run finish, and learn?

A seeded run of ``--devices`` simulated devices on Flower's Simulation Engine (``edgefleet
run``'s ``run_scenario``, the real ServerApp and ClientApp) in which one device in
``--every`` is hostile (the partitions p with p % every == every - 1), once per kind of
lie, against the same run with every device honest. The hostile partitions train honestly
and then spoil every train reply (the ClientApp with the test-only fault mod,
``fleetharness.faults``, which EdgeFleet's own ClientApp never adds; kinds there):

- ``inf-examples``: ``num-examples`` = inf;
- ``huge-examples``: ``num-examples`` = 1e9 with every weight zero (under plain FedAvg this
  reply would replace the model);
- ``scaled``: every weight x 1e30 (finite);
- ``nan``: NaN weights;
- ``spoof-id``: the device id of its neighbour (which then cannot be trusted either);
- ``bad-metrics``: an extra metric, a missing one and a list-valued one (a usable reply:
  accepted, the odd metrics left out of the average);
- ``noise``: Gaussian noise of each tensor's shape and spread.

Prints one JSON line: per kind ``accuracy_delta`` (final accuracy minus the clean run's),
``rounds_completed``, ``rejected`` (replies rejected over the run), ``rounds_dropped`` and
the first rejection reason; the clean run's figures, with the spread of honest update
norms around the round's median (``update_norm_max_ratio``, what ``screening.norm-factor``
is compared with); and ``target_met``: every run completed all rounds and ended within
``--max-drop`` of the clean run's accuracy. Runs are kept under ``--out`` and reused when a
finished one of the same config is there (an interrupted campaign resumes).

``--engine inprocess`` runs the same ServerApp ``main`` and the same ClientApp (Flower's
``ClientApp`` object, mods included) in this process, over a grid that hands each message
to the ClientApp of the node it is addressed to, every node keeping its own ``Context``;
only Flower's transport and Ray are left out. Use it where Ray cannot run (on a machine
whose memory is nearly all in use, Ray's memory monitor kills the ClientApp actors, and
those devices' rounds come back as errors).

Example (the issue's size)::

    nice -n 15 .venv/bin/python -m benchmarks.soak.fault_campaign --devices 10 --rounds 30
    nice -n 15 .venv/bin/python -m benchmarks.soak.fault_campaign --engine inprocess
    .venv/bin/python -m benchmarks.soak.fault_campaign --smoke --out /tmp/fc   # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.provenance import dumps
from benchmarks.lib.runs import ENGINES, parse_with_smoke, run_once
from edgefleet.simulation.runner import load_scenario, parse_value

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("inf-examples", "huge-examples", "scaled", "nan", "spoof-id", "bad-metrics", "noise")
# --smoke: 3 devices, one hostile, a kind that is rejected and one that is accepted.
SMOKE: dict[str, Any] = {
    "devices": 3,
    "rounds": 3,
    "every": 3,
    "kinds": "nan,noise",
    "engine": "inprocess",
    "set": ["local-steps=2", "eval-samples=200"],
}


def summarize(rows: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    rejected = [r for row in rows for r in row["rejected"]]
    ratios = [row["update_norm_max_ratio"] for row in rows if "update_norm_max_ratio" in row]
    return {
        "final_accuracy": summary["final_accuracy"],
        "rounds_completed": summary["rounds_run"],
        "rejected": len(rejected),
        "rounds_dropped": sum(1 for row in rows if row.get("round_dropped")),
        "mean_participants": round(statistics.mean(len(row["participants"]) for row in rows), 2),
        "first_reason": rejected[0]["reason"] if rejected else None,
        "update_norm_max_ratio": max(ratios) if ratios else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "fedavg.toml"))
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="one device in EVERY is hostile")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    parser.add_argument("--max-drop", type=float, default=0.02, help="target: accuracy points")
    parser.add_argument("--out", default="runs/fault_campaign")
    parser.add_argument("--timeout", type=float, default=4 * 3600)
    parser.add_argument("--attempts", type=int, default=3, help="tries a run gets to start")
    parser.add_argument("--engine", choices=ENGINES, default="simulation")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override"
    )
    args = parse_with_smoke(parser, SMOKE)
    kinds = [k for k in args.kinds.split(",") if k]
    hostile = [p for p in range(args.devices) if p % args.every == args.every - 1]
    if not hostile:
        raise SystemExit(f"--every {args.every} leaves no hostile device among {args.devices}")
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    scenario = load_scenario(args.scenario, overrides)
    federation = {**scenario.federation, "num-supernodes": args.devices}
    base = {**scenario.run_config, "num-server-rounds": args.rounds, "min-nodes": args.devices}
    out = Path(args.out).resolve()
    t0 = time.monotonic()

    def run(name: str, faults: tuple[str, list[int]] | None) -> dict[str, Any]:
        for attempt in range(1, args.attempts + 1):
            try:
                rows = run_once(
                    out, name, federation, base, args.timeout, engine=args.engine, faults=faults
                )
                return summarize(rows, out / name)
            except RuntimeError as err:
                # On a loaded machine Ray's raylet can miss its fixed 30 s start-up window
                # ("The current node timed out during startup"): the run never started.
                print(f"{name}: attempt {attempt} failed: {err}", file=sys.stderr)
                if attempt == args.attempts:
                    raise
        raise AssertionError("unreachable")

    clean = run("clean", None)
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        res = run(kind, (kind, hostile))
        delta = res["final_accuracy"] - clean["final_accuracy"]
        results[kind] = {"accuracy_delta": round(delta, 4), **res}
    # None: no hostile kind was run (--kinds ''), so there is nothing to judge.
    target_met = (
        all(
            r["rounds_completed"] == args.rounds and r["accuracy_delta"] >= -args.max_drop
            for r in results.values()
        )
        and clean["rounds_completed"] == args.rounds
        if results
        else None
    )
    print(
        dumps(
            {
                "benchmark": "fault_campaign",
                "sizes": {
                    k: getattr(args, k)
                    for k in ("devices", "rounds", "every", "kinds", "max_drop", "engine")
                    + ("smoke",)
                },
                "engine": args.engine,
                "scenario": Path(args.scenario).name,
                "devices": args.devices,
                "rounds": args.rounds,
                "hostile_partitions": hostile,
                "set": overrides,
                "clean": clean,
                "kinds": results,
                "target": f"all {args.rounds} rounds, accuracy within {args.max_drop} of clean",
                "target_met": target_met,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
