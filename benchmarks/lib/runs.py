"""Shared by the claim benchmarks: one run per name, reused when it already finished.

Two engines run a scenario:

- ``simulation``: Flower's Simulation Engine (``edgefleet run``: a SuperLink, Ray actors).
- ``inprocess``: EdgeFleet's in-process engine (:mod:`edgefleet.simulation.inprocess`): the
  same ServerApp in a child process, over a grid that hands each message to the ClientApp
  (its mods included) of its node, on one worker process per core. Same apps, same config,
  same seeds, the same rows (``tests/test_engines.py``); no SuperLink, no Ray. For long
  sweeps on a loaded machine, where Ray's start-up costs minutes a run and can time out
  ("The current node timed out during startup") when its processes are niced.

``faults=(kind, partitions)`` runs the ClientApp with the test-only fault mod instead
(:mod:`fleetharness.faults`): those partitions spoil every train reply as ``kind``. The
run config cannot ask for that, so the run folder records it in ``faults.json``.

``InProcessGrid`` here is the engine's :class:`~edgefleet.simulation.inprocess.ClientAppGrid`
(``benchmarks/claims/norm_ratios.py`` drives a round loop over it).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from edgefleet.simulation.inprocess import ClientAppGrid as InProcessGrid  # noqa: F401
from edgefleet.simulation.inprocess import InProcessEngine
from edgefleet.simulation.runner import Engine, Scenario, resolve_run_config, run_scenario

ENGINES: tuple[str, ...] = ("simulation", "inprocess")
FAULTS_FILE = "faults.json"
Faults = tuple[str, tuple[int, ...]]  # (kind, partitions) for fleetharness.faults


def parse_with_smoke(p: argparse.ArgumentParser, smoke: Mapping[str, Any]) -> argparse.Namespace:
    """``p``'s arguments, with ``--smoke``: the defaults become ``smoke`` (the smallest sizes
    that still run the benchmark's whole path, in seconds; ``tests/test_benchmarks_smoke.py``
    runs it), and flags given explicitly still win."""
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items())
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {shown}")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="--engine inprocess: worker processes per run (0: one per core; --smoke: 1); "
        "the rows do not depend on it (tests/test_engines.py)",
    )
    if p.parse_known_args()[0].smoke:
        # A worker pool's start-up (a forkserver importing torch: seconds) would be most of
        # a smoke run; tests/test_engines.py checks the pool gives the same rows.
        p.set_defaults(**{"workers": 1, **smoke})
    args = p.parse_args()
    if args.workers < 0:
        p.error(f"--workers {args.workers}: must be 0 (one per core) or more")
    global _default_workers
    _default_workers = args.workers or None
    return args


_default_workers: int | None = None  # the in-process engine's workers (None: one per core)


def run_cells(cells: Sequence[Mapping[str, str]], jobs: int, logs: Path) -> None:
    """Run a benchmark's cells ``jobs`` at a time, each in a copy of this benchmark's own
    command with the cell's flags (e.g. ``{"variants": "full", "seeds": "1"}``) in place of
    the command's; each copy's output goes to ``logs/cell-<i>.log``.

    The first half of ``--jobs N``: the benchmark's own loop runs afterwards and, since
    :func:`run_once` reuses a finished run, only reads what the copies ran. Raises
    RuntimeError naming the cells that failed (after every cell has ended)."""
    import subprocess

    base = _without_flags(sys.argv[1:], {"--jobs", *(f"--{k}" for c in cells for k in c)})
    logs.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(cells))
    running: list[tuple[int, Mapping[str, str], subprocess.Popen[bytes]]] = []
    failed = []
    while pending or running:
        while pending and len(running) < jobs:
            i, cell = pending.pop(0)
            flags = [a for k, v in cell.items() for a in (f"--{k}", v)]
            with (logs / f"cell-{i}.log").open("wb") as log:
                cmd = [sys.executable, sys.argv[0], *base, *flags, "--jobs", "1"]
                running.append((i, cell, subprocess.Popen(cmd, stdout=log, stderr=log)))
        time.sleep(1.0)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            if item[2].returncode != 0:
                failed.append(f"{dict(item[1])} (exit {item[2].returncode}, cell-{item[0]}.log)")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(cells)} cells failed in {logs}: {failed}")


def _without_flags(argv: Sequence[str], flags: set[str]) -> list[str]:
    """``argv`` less every ``--flag value`` and ``--flag=value`` whose flag is in ``flags``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


def run_once(
    out: Path,
    name: str,
    federation: dict[str, Any],
    run_config: dict[str, Any],
    timeout: float,
    engine: str = "simulation",
    faults: tuple[str, Iterable[int]] | None = None,
) -> list[dict[str, Any]]:
    """Run ``name`` on ``engine`` unless ``out/name`` holds a finished run of the same config
    and faults (so an interrupted sweep resumes where it stopped); its metrics rows. A
    finished run of another config is an error, not silently reused."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid choices: {', '.join(ENGINES)}")
    lies: Faults | None = None
    if faults is not None:
        from fleetharness.faults import fault_mod

        lies = (faults[0], tuple(faults[1]))
        fault_mod(*lies)  # bad settings fail here, not inside every ClientApp
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
        if _stored_faults(run_dir) != lies:
            changed.append("faults")
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
        if engine == "simulation":
            run_scenario(scenario, timeout=timeout, quiet=True, engine=_engine(lies))
        else:
            run_inprocess(scenario, out / f"{name}.log", timeout, lies)
        if lies is not None:
            record = {"kind": lies[0], "partitions": list(lies[1])}
            (run_dir / FAULTS_FILE).write_text(json.dumps(record) + "\n")
        print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stored_faults(run_dir: Path) -> Faults | None:
    path = run_dir / FAULTS_FILE
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    return stored["kind"], tuple(stored["partitions"])


def _engine(faults: Faults | None) -> Engine | None:
    """The Simulation Engine for a run with ``faults``: the ClientApp component with the
    fault mod, which reads the lying partitions from the environment that its Ray actors
    inherit (None: ``run_scenario``'s own engine, EdgeFleet's ClientApp)."""
    if faults is None:
        return None
    from fleetharness.faults import FAULTS_ENV, FAULTY_APP, faults_env

    engine = Engine(clientapp=FAULTY_APP)
    engine.fleet.env[FAULTS_ENV] = faults_env(*faults)
    return engine


def run_inprocess(
    scenario: Scenario,
    log_path: Path,
    timeout: float,
    faults: Faults | None = None,
    workers: int | None = None,
) -> None:
    """Run ``scenario`` with the ``inprocess`` engine (:mod:`edgefleet.simulation.inprocess`:
    a child process forked from this one once it has imported torch, Flower and the apps,
    ``workers`` worker processes for the ClientApps, None: one per core); its log in
    ``log_path`` as it is written."""
    workers = workers or _default_workers
    app = None
    if faults is not None:
        from fleetharness.faults import faulty_clientapp

        app = functools.partial(faulty_clientapp, *faults)  # picklable: workers build it
    engine = _ENGINES.setdefault((faults, workers), InProcessEngine(workers=workers, app=app))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        engine.run(scenario, timeout=timeout, echo=log)


# One engine per app and pool size, for the whole benchmark: the imports are paid once.
_ENGINES: dict[tuple[Faults | None, int | None], InProcessEngine] = {}
