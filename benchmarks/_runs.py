"""Shared by the claim benchmarks: one run per name, reused when it already finished."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from edgefleet.simulation.runner import Scenario, resolve_run_config, run_scenario


def run_once(
    out: Path,
    name: str,
    federation: dict[str, Any],
    run_config: dict[str, Any],
    timeout: float,
    engine: str = "simulation",
) -> list[dict[str, Any]]:
    """Run ``name`` on the Simulation Engine (or, ``engine="inprocess"``, the same apps in
    this process: :mod:`_inprocess`) unless ``out/name`` holds a finished run of the same
    config (so an interrupted sweep resumes where it stopped); its metrics rows. A finished
    run of another config is an error, not silently reused."""
    run_dir = out / name
    config = {**run_config, "output-dir": str(out), "run-name": name}
    summary = run_dir / "summary.json"
    if summary.exists():
        wanted = resolve_run_config(Scenario(name, federation, config))[0].to_dict()
        stored = json.loads(summary.read_text())["config"]
        # Where data and results live is not a setting; keys newer than the stored run are
        # at their defaults.
        changed = sorted(
            k
            for k in set(wanted) & set(stored) - {"data-dir", "output-dir", "run-name"}
            if stored[k] != wanted[k]
        )
        if changed:
            raise SystemExit(
                f"{run_dir} holds a run with other settings ({', '.join(changed)}); "
                "remove it or choose another --out"
            )
    else:
        if run_dir.exists():  # an unfinished run: start it again
            shutil.rmtree(run_dir)
        t0 = time.monotonic()
        scenario = Scenario(name, federation, config)
        if engine == "inprocess":
            from _inprocess import run_inprocess

            run_inprocess(int(federation["num-supernodes"]), resolve_run_config(scenario)[1])
        else:
            run_scenario(scenario, timeout=timeout, quiet=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
