"""How far do honest updates stray from the round's median update norm? (choosing k)

The screening bound rejects a reply whose update norm is above k x the median of the
round's update norms (``screening.norm-factor``). k must sit above what honest devices do,
across data splits, pruned devices, few devices a round and strategies. This benchmark runs
honest fleets and records, for every accepted reply, its update norm divided by the
round's median (the ratio the bound compares with k).

Each configuration is the real thing minus the transport: EdgeFleet's ClientApp ``train``
function (its data partitions, models, local SGD, CA-HFP submodels), EdgeFleet's server
stack (``build_strategy``) and the real round loop with its screening, which computes the
norms; the bound is set out of reach (k = 1e12) so that nothing is rejected and every ratio
is seen. Messages go through an in-process grid instead of Flower's Simulation Engine: the
norms do not depend on how the bytes travel, and this runs several times faster on a
shared 2-core machine.

Prints one JSON line: per configuration the number of ratios, their quantiles and maximum,
and the largest ratio over all (``max_ratio``), with the sizes. Example::

    .venv/bin/python -m benchmarks.claims.norm_ratios --rounds 20 --devices 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from benchmarks.lib.overrides import add_set_arg, parse_sets
from benchmarks.lib.runs import InProcessGrid
from edgefleet.config import parse_run_config
from edgefleet.loop.roundloop import RoundCallback, RoundLoop, RoundResult
from edgefleet.loop.screening import Screening
from edgefleet.server.app import build_strategy, screening_for
from edgefleet.task.datasets import dataset_info
from edgefleet.task.models import build_model
from edgefleet.task.train import get_arrays

CONFIGS: dict[str, dict[str, Any]] = {
    "dirichlet-0.5": {},
    "dirichlet-0.1": {"alpha": 0.1},
    "iid": {"partition": "iid"},
    "shards-2": {"partition": "shards"},
    "ca-hfp-4-classes": {"pruning.keep-ratios": "1.0,0.75,0.5,0.25"},
    "3-of-10-a-round": {"fraction-train": 0.3},
    "fedprox": {"strategy": "fedprox"},
    "fedsag-3-of-10": {"strategy": "fedsag", "fraction-train": 0.3},
}


def measure(name: str, overrides: dict[str, Any], devices: int, rounds: int) -> dict[str, Any]:
    run_config = {"min-nodes": 1, **overrides}
    cfg = parse_run_config(run_config)

    grid = InProcessGrid(run_config, devices)
    strategy = build_strategy(cfg)
    info = dataset_info(cfg.data.dataset)
    import torch

    torch.manual_seed(cfg.seed)
    initial = get_arrays(build_model(cfg.train.model, info.input_shape, info.num_classes))
    ratios: list[float] = []
    round_max: list[float] = []

    class Collect(RoundCallback):
        def after_round(self, result: RoundResult) -> str | None:
            norms = list(result.context.update_norms.values())
            if len(norms) >= 3:
                median = float(np.median(norms))
                r = [n / median for n in norms]
                ratios.extend(r)
                round_max.append(max(r))
            return None

    screening = Screening(**{**screening_for(cfg).__dict__, "norm_factor": 1e12})
    loop = RoundLoop(
        strategy,
        grid,  # type: ignore[arg-type]
        callbacks=[*strategy.round_callbacks(), Collect()],  # type: ignore[attr-defined]
        screening=screening,
    )
    t0 = time.monotonic()
    loop.run(initial, rounds)
    print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    a = np.asarray(ratios)
    return {
        "ratios": len(a),
        "p50": round(float(np.quantile(a, 0.5)), 3),
        "p90": round(float(np.quantile(a, 0.9)), 3),
        "p99": round(float(np.quantile(a, 0.99)), 3),
        "max": round(float(a.max()), 3),
        "min": round(float(a.min()), 3),
        "round_max_median": round(float(np.median(round_max)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    add_set_arg(parser)
    args = parser.parse_args()
    common = parse_sets(parser, args.set)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; valid: {', '.join(CONFIGS)}")
    t0 = time.monotonic()
    results = {n: measure(n, {**common, **CONFIGS[n]}, args.devices, args.rounds) for n in names}
    print(
        json.dumps(
            {
                "benchmark": "norm_ratios",
                "devices": args.devices,
                "rounds": args.rounds,
                "set": common,
                "configs": {n: {"run_config": CONFIGS[n], **r} for n, r in results.items()},
                "max_ratio": max(r["max"] for r in results.values()),
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
