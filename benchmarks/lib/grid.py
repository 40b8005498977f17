"""Shared by the benchmarks: the flags every claim benchmark takes, the sweep that runs its
grid (:mod:`edgefleet.simulation.sweep`: one SuperLink and one Ray cluster for all runs,
finished runs reused, a killed run resumed from its checkpoint), and the one JSON line each
prints at the end.

A claim benchmark is then its grid and its figures::

    p = argparse.ArgumentParser(...)
    add_common_args(p, out="bench-x", devices=10, local_steps=10)
    p.add_argument("--alphas", default="0.1,1.0")           # its own flags
    args = p.parse_args()
    points = [Point(f"a{a:g}", {"alpha": a}) for a in floats(args.alphas)]
    rows = run_grid(args, points, run_config={...}, federation={...})
    emit("x_claims", args, {"settings": ...}, sizes=("alphas",))
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.overrides import add_key_args
from benchmarks.lib.provenance import stamp
from edgefleet.simulation.report import load_run
from edgefleet.simulation.runner import Scenario
from edgefleet.simulation.sweep import Point, Sweep, parse_seeds

ROOT = Path(__file__).resolve().parents[2]
_T0 = time.monotonic()
COMMON = ("devices", "local_steps", "lr", "model", "seeds", "data_dir")


def add_common_args(
    p: argparse.ArgumentParser,
    *,
    out: str,
    devices: int = 10,
    local_steps: int = 10,
    lr: float = 0.05,
    model: str = "smallcnn",
    seeds: str = "0,1,2",
) -> None:
    """``--out``, ``--devices``, ``--local-steps``, ``--lr``, ``--model``, ``--seeds``,
    ``--data-dir`` and ``--timeout``, with this benchmark's defaults."""
    p.add_argument("--out", default=str(ROOT / "runs" / out), help="run folders go here")
    p.add_argument("--devices", type=int, default=devices, help="simulated devices (K)")
    add_key_args(p, {"local-steps": local_steps, "lr": lr, "model": model, "data-dir": ""})
    p.add_argument("--seeds", default=seeds, help="comma-separated seeds")
    p.add_argument("--timeout", type=float, default=12 * 3600, help="seconds per run")


def common_run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config keys the common flags set."""
    return {
        "local-steps": args.local_steps,
        "lr": args.lr,
        "model": args.model,
        "data-dir": str(Path(args.data_dir).resolve()) if args.data_dir else "",
    }


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_grid(
    args: argparse.Namespace,
    points: Sequence[Point],
    run_config: Mapping[str, Any],
    federation: Mapping[str, Any] | None = None,
    name: str = "bench",
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Run ``points`` x ``--seeds`` (what finished before is reused) into ``--out``; the
    metrics rows by (point name, seed). A failed run ends the benchmark with its reason."""
    base = Scenario(
        name,
        {"num-supernodes": args.devices, "client-resources-num-cpus": 1, **(federation or {})},
        {**common_run_config(args), **run_config},
    )
    sweep = Sweep(base, points, parse_seeds(args.seeds), Path(args.out), timeout=args.timeout)
    runs = sweep.run()
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        raise SystemExit("\n".join(f"{r.run_dir.name}: {r.error}" for r in failed))
    return {(r.point.name, r.seed): load_run(r.run_dir).rows for r in runs}


def emit(
    benchmark: str, args: argparse.Namespace, result: Mapping[str, Any], sizes: Iterable[str] = ()
) -> None:
    """Print the benchmark's one JSON line: its name, its sizes (the common flags and
    ``sizes``), ``result`` and the wall time."""
    names = [*(n for n in COMMON if hasattr(args, n)), *sizes]
    line = {
        "benchmark": benchmark,
        "sizes": {n: getattr(args, n) for n in names},
        **result,
        "wall_s": round(time.monotonic() - _T0, 1),
    }
    print(json.dumps(stamp(line)), flush=True)
    sys.stdout.flush()
