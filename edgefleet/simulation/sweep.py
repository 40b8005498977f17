"""Sweeps: one scenario over a grid of settings and several seeds, on one engine.

``edgefleet sweep scenarios/fedavg.toml --grid alpha=0.1,1.0 --seeds 0,1,2`` runs the six
runs one after the other into ``runs/fedavg-sweep/`` (``--name``, ``--set output-dir=...``),
then prints the comparison table (mean and spread over the seeds of each grid point) and
draws the plots with ``edgefleet report``. The SuperLink and the Ray cluster start once for
the whole sweep (each run still gets its own ServerApp process and fresh Ray actors), and the
data set is checked once before the first run. ``--engine inprocess`` runs them on the
in-process engine instead (:mod:`edgefleet.simulation.inprocess`, one for the whole sweep).

A sweep resumes where it stopped: a run whose folder holds a summary of the same config is
skipped, a run killed midway continues from its last checkpoint (``resume``), and
``sweep.json`` in the sweep folder records what the sweep is, so that a folder is never
reused for another scenario by mistake.

Benchmarks use the same machinery from Python::

    sweep = Sweep(base, grid_points({"alpha": [0.1, 1.0]}), seeds=[0, 1, 2], out=Path(...))
    runs = sweep.run()            # [SweepRun(point, seed, run_dir, status), ...]

with :class:`Point` s of their own where one grid point sets several keys at once.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from edgefleet import runlock
from edgefleet.config import ConfigError
from edgefleet.fileio import atomic_write_text
from edgefleet.simulation.runner import (
    RAY_ADDRESS_WITH_SIZES,
    RAY_CLUSTER_KEYS,
    Engine,
    RunFailed,
    Scenario,
    check_data,
    check_engine,
    check_federation,
    parse_value,
    resolve_run_config,
)

if TYPE_CHECKING:
    from edgefleet.simulation.inprocess import InProcessEngine

MANIFEST = "sweep.json"
# Where data and results live, and how a run was started, are not settings of the run.
NOT_SETTINGS = ("output-dir", "run-name", "data-dir", "resume")


@dataclass(frozen=True)
class Point:
    """One grid point: a name (part of its runs' folder names) and the keys it sets
    (run-config keys, or ``federation.KEY``)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepRun:
    point: Point
    seed: int
    run_dir: Path
    status: str = "pending"  # "done" (found finished), "ran", "resumed", "failed"
    error: str = ""


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["alpha=0.1,1.0", ...]`` -> ``{"alpha": [0.1, 1.0]}``. A value list in TOML array
    syntax (``'pruning.keep-ratios=["1.0,0.5", "1.0"]'``) keeps commas inside values."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key, values = key.strip(), values.strip()
        if not sep or not key or not values:
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,...")
        if values.startswith("["):
            parsed = parse_value(values)
            if not isinstance(parsed, list) or not parsed:
                raise ConfigError(f"--grid {item!r}: not a TOML array of values")
            grid[key] = parsed
        else:
            grid[key] = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
        if key in grid and len(set(map(repr, grid[key]))) != len(grid[key]):
            raise ConfigError(f"--grid {item!r}: a value appears twice")
    if "seed" in grid:
        raise ConfigError("--grid seed=...: give seeds with --seeds, they are averaged over")
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected integers such as 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: expected distinct integers such as 0,1,2")
    return seeds


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[Point]:
    """The Cartesian product of ``grid``, in its key order (no grid: one point, ``base``)."""
    if not grid:
        return [Point("base", {})]
    keys = list(grid)
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        name = ",".join(f"{k}={_short(v)}" for k, v in zip(keys, values, strict=True))
        points.append(Point(name, dict(zip(keys, values, strict=True))))
    return points


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value).lower()


def run_name(point: Point, seed: int) -> str:
    """A run's folder name: the point's name and the seed, safe on any file system."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", f"{point.name},seed={seed}")


class Sweep:
    """``points`` x ``seeds`` runs of ``base`` into ``out``, on one engine.

    ``base.run_config`` and ``base.federation`` hold what every run shares; a point's
    overrides and the seed come on top. Failed runs do not stop the sweep: they are
    reported at the end (``SweepRun.status == "failed"``).
    """

    def __init__(
        self,
        base: Scenario,
        points: Sequence[Point],
        seeds: Sequence[int],
        out: Path,
        *,
        timeout: float = 3600.0,
        ray_address: str | None = None,
        echo: TextIO | None = None,
        log: TextIO = sys.stderr,
        engine: str = "simulation",
        workers: int | None = None,
    ) -> None:
        if len({p.name for p in points}) != len(points):
            raise ConfigError("two grid points have the same name")
        check_engine(engine, ray_address, workers)
        self.engine, self.workers = engine, workers
        self.base, self.points, self.seeds = base, list(points), list(seeds)
        self.out = out.resolve()
        self.timeout, self.ray_address, self.echo, self.log = timeout, ray_address, echo, log
        self.runs = [
            SweepRun(p, s, self.out / run_name(p, s)) for p in self.points for s in self.seeds
        ]

    def scenario(self, run: SweepRun, resume: bool = False) -> Scenario:
        federation = dict(self.base.federation)
        run_config = dict(self.base.run_config)
        for key, value in run.point.overrides.items():
            if key.startswith("federation."):
                federation[key.removeprefix("federation.")] = value
            else:
                run_config[key] = value
        run_config.update(
            {"seed": run.seed, "output-dir": str(self.out), "run-name": run.run_dir.name}
        )
        if resume:
            run_config["resume"] = True
        return Scenario(self.base.name, federation, run_config)

    def manifest(self) -> dict[str, Any]:
        return {
            "scenario": self.base.name,
            "federation": self.base.federation,
            "run-config": {k: v for k, v in self.base.run_config.items() if k not in NOT_SETTINGS},
            "points": [asdict(p) for p in self.points],
            "seeds": self.seeds,
            "runs": [
                {"run": r.run_dir.name, "point": r.point.name, "seed": r.seed} for r in self.runs
            ],
        }

    def check(self) -> None:
        """Every run's config, federation and data, before the first run starts."""
        for run in self.runs:
            scenario = self.scenario(run)
            check_federation(scenario.federation, f"grid point {run.point.name}")
            if self.ray_address and any(k in scenario.federation for k in RAY_CLUSTER_KEYS):
                raise ConfigError(RAY_ADDRESS_WITH_SIZES)
            resolve_run_config(scenario)
        for run_dir in (r.run_dir for r in self.runs):
            if run_dir.exists() and not (run_dir / "metrics.jsonl").exists():
                _discard(run_dir)  # started, nothing recorded: start again
        manifest = self.out / MANIFEST
        mine = self.manifest()
        if manifest.exists():
            stored = json.loads(manifest.read_text())
            # A sweep may gain points and seeds; its scenario and base config may not change.
            if any(stored.get(k) != mine[k] for k in ("scenario", "federation", "run-config")):
                raise ConfigError(
                    f"{self.out} holds a sweep of another scenario or base config "
                    f"({manifest}); choose another --name or remove it"
                )
            names = {r["run"] for r in mine["runs"]}
            mine["runs"] = [r for r in stored["runs"] if r["run"] not in names] + mine["runs"]
            points = {p["name"] for p in mine["points"]}
            mine["points"] = [p for p in stored["points"] if p["name"] not in points] + mine[
                "points"
            ]
            mine["seeds"] = sorted(set(stored["seeds"]) | set(self.seeds))
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(manifest, json.dumps(mine, indent=2) + "\n")
        datasets = {}
        for run in self.runs:
            cfg, _ = resolve_run_config(self.scenario(run))
            datasets[(cfg.data.dataset, cfg.data.data_dir)] = cfg
        for cfg in datasets.values():
            check_data(cfg)

    def _finished(self, run: SweepRun) -> bool:
        summary = run.run_dir / "summary.json"
        if not summary.exists():
            return False
        wanted = resolve_run_config(self.scenario(run))[0].to_dict()
        stored = json.loads(summary.read_text()).get("config", {})
        changed = sorted(
            k for k in set(wanted) & set(stored) - set(NOT_SETTINGS) if stored[k] != wanted[k]
        )
        if changed:
            raise ConfigError(
                f"{run.run_dir} holds a finished run with other settings ({', '.join(changed)}); "
                "remove it or choose another --name"
            )
        return True

    def run(self) -> list[SweepRun]:
        """Run what is not finished yet; every run's status."""
        self.check()
        engine: Engine | InProcessEngine | None = None
        engine_key: tuple[Any, ...] = ()
        if self.engine == "inprocess":  # one for the whole sweep: its imports paid once
            from edgefleet.simulation.inprocess import InProcessEngine

            engine = InProcessEngine(workers=self.workers)
        try:
            for i, run in enumerate(self.runs, start=1):
                label = f"[{i}/{len(self.runs)}] {run.run_dir.name}"
                if self._finished(run):
                    run.status = "done"
                    self._say(f"{label}: finished before, skipped")
                    continue
                resume = (run.run_dir / "metrics.jsonl").exists()
                if resume and not any(run.run_dir.glob("checkpoint*")):
                    _discard(run.run_dir)  # killed before its first checkpoint
                    resume = False
                scenario = self.scenario(run, resume=resume)
                key = tuple(scenario.federation.get(k) for k in RAY_CLUSTER_KEYS)
                if isinstance(engine, Engine) and (key != engine_key or not engine.alive()):
                    engine.__exit__(None, None, None)  # one Ray cluster at a time
                    engine = None
                if engine is None:
                    engine = Engine(ray_address=self.ray_address, ray_cpus=key[0], ray_gpus=key[1])
                    engine.__enter__()
                    engine_key = key
                self._say(f"{label}: {'resuming' if resume else 'running'}")
                t0 = time.monotonic()
                try:
                    engine.run(scenario, timeout=self.timeout, echo=self.echo)
                except RunFailed as err:
                    run.status, run.error = "failed", str(err)
                    self._say(f"{label}: FAILED: {err}")
                    continue
                run.status = "resumed" if resume else "ran"
                self._say(f"{label}: done in {time.monotonic() - t0:.0f} s")
        finally:
            if engine is not None:
                engine.__exit__(None, None, None)
        return self.runs

    def _say(self, text: str) -> None:
        print(text, file=self.log, flush=True)


def _discard(run_dir: Path) -> None:
    """Remove a run folder that recorded nothing worth keeping, unless a process writes it
    (another sweep of the same folder, just starting that run): that is refused."""
    try:
        runlock.check(run_dir)
    except runlock.RunLocked as err:
        raise ConfigError(str(err)) from None
    shutil.rmtree(run_dir)
