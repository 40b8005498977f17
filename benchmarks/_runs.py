"""Shared by the claim benchmarks: one run per name, reused when it already finished."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from edgefleet.simulation.runner import Scenario, run_scenario


def run_once(
    out: Path, name: str, federation: dict[str, Any], run_config: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    """Run ``name`` on the Simulation Engine unless ``out/name`` holds a finished run (so an
    interrupted sweep resumes where it stopped); its metrics rows."""
    run_dir = out / name
    if not (run_dir / "summary.json").exists():
        if run_dir.exists():  # an unfinished run: start it again
            for f in run_dir.iterdir():
                f.unlink()
        config = {**run_config, "output-dir": str(out), "run-name": name}
        t0 = time.monotonic()
        run_scenario(Scenario(name, federation, config), timeout=timeout, quiet=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
