"""What every benchmark's JSON line records about how it was made, so that a line saved under
``benchmarks/results/`` can be re-run and checked (the convention in
``benchmarks/claims/table.py``):
the command (``sys.argv``), the git commit the code was at when it started, whether the work
tree had uncommitted changes to tracked files then, and the wall time.

Standard library only: ``deploy_overhead`` and ``sim_overhead`` import it before anything
heavy, and the claim benchmarks beside ``runs``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Imported at a benchmark's start: the fallback wall time for a line that has none of its own.
_T0 = time.monotonic()


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _code_version() -> tuple[str | None, bool | None]:
    """The git commit and whether tracked files had changed."""
    if os.environ.get("BENCHMARK_GIT_COMMIT"):
        # A copy of the tree on another machine (benchmarks/device/): the copier's commit, as
        # `git rev-parse HEAD` there, with "+dirty" when tracked files had changed. Its own
        # git metadata, where the copy has any, need not be the copier's.
        commit, _, suffix = os.environ["BENCHMARK_GIT_COMMIT"].partition("+")
        return commit, suffix == "dirty"
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, None if status is None else bool(status)


# Taken when a benchmark starts (it imports this module first): the code it runs is the
# code of its start; a commit made while a long run goes on is not it.
_VERSION = _code_version()


def provenance() -> dict[str, Any]:
    """``command`` (as typed, relative to the repository root where it can be), ``git_commit``
    and ``git_dirty`` at the benchmark's start (None, None when this is not a git checkout or
    git is missing)."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is not None and script.suffix == ".py" and script.is_relative_to(ROOT / "benchmarks"):
        # A module of this package: the form it is run by (`python -m benchmarks.perf.x`).
        first = ["-m", ".".join(script.relative_to(ROOT).with_suffix("").parts)]
    elif script is not None and script.is_relative_to(ROOT):
        first = [str(script.relative_to(ROOT))]
    else:
        first = [sys.argv[0] if sys.argv else ""]
    commit, dirty = _VERSION
    return {
        "command": shlex.join(["python", *first, *sys.argv[1:]]),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def machine() -> dict[str, Any]:
    """The cores and the GPU (NVIDIA's driver's name for it, or None) a benchmark ran on, for
    lines whose figures depend on them (accuracy does not; wall time does)."""
    gpu = None
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            gpu = proc.stdout.strip().splitlines()[0].split(" (UUID")[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpus": os.cpu_count(), "gpu": gpu}


def stamp(line: Mapping[str, Any]) -> dict[str, Any]:
    """``line`` with :func:`provenance` after its ``benchmark`` key, and ``wall_s`` (since this
    module was imported) when the line has none of its own."""
    head = {k: v for k, v in line.items() if k == "benchmark"}
    rest = {k: v for k, v in line.items() if k != "benchmark"}
    out = {**head, **provenance(), **rest}
    if out.get("wall_s") is None:
        out["wall_s"] = round(time.monotonic() - _T0, 1)
    return out


def dumps(line: Mapping[str, Any]) -> str:
    """The benchmark's JSON line: ``json.dumps(stamp(line))``."""
    return json.dumps(stamp(line))
