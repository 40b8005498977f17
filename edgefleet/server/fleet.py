"""The live fleet snapshot: ``fleet.json`` in the run folder, rewritten after every round;
and the batteries' history, ``batteries.jsonl``, a line per round appended beside it.

A live run is observable from its run folder alone: ``metrics.jsonl`` (a row per round),
``fleet.json`` (the fleet as the server sees it now) and the checkpoint. The snapshot is the
round loop's device registry (which node speaks for which device, each device's last
status, its screened telemetry and the reasons any of it was dropped, participations,
declines and rejections with their reasons) plus the run's state
(round, session, accuracy, the stopping signal, the round's selection). It is written
atomically (a reader never sees half a file), so a dashboard or an exporter can poll it
without ever slowing or breaking a round. Format: ``FORMAT``; every value comes from the
server's own checked state, so nothing a device sent reaches it unchecked.

``batteries.jsonl`` holds ``{"round": r, "batteries": {device: level}}`` for each round in
which some device's battery is known (energy on): the battery chart's history, which
``metrics.jsonl`` leaves out to keep its rows small at a thousand devices. A resumed run
appends the rounds it runs again; a reader keeps the last line of each round.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from edgefleet.fileio import atomic_write_text, open_append
from edgefleet.loop.context import SelectionRow, SessionRow, StoppingRow
from edgefleet.loop.roundloop import RoundCallback, RoundResult

FILENAME = "fleet.json"
BATTERIES = "batteries.jsonl"
FORMAT = 1


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def snapshot(result: RoundResult, stopping_tau: float | None = None) -> dict[str, Any]:
    """The fleet after ``result``'s round, JSON-ready."""
    ctx = result.context
    selection, sessions = ctx.find(SelectionRow), ctx.find(SessionRow)
    stopping = ctx.find(StoppingRow)
    return {
        "format": FORMAT,
        "written_at": time.time(),
        "round": result.round,
        "session": result.session,
        "phase": None if sessions is None else str(sessions.phase),
        "test_accuracy": _finite(result.eval_metrics.get("test_accuracy")),
        "participants": list(result.participants),
        "declined": list(result.declined),
        "unreachable": list(result.unreachable),
        "rejected": list(result.rejected),
        "selected": None if selection is None else list(selection.selected),
        "task_vector_growth": None if stopping is None else _finite(stopping.task_vector_growth),
        "stopping_tau": stopping_tau,
        "devices": ctx.registry.snapshot(ctx.online()),
    }


def batteries_line(fleet: dict[str, Any]) -> dict[str, Any] | None:
    """A snapshot's batteries as a ``batteries.jsonl`` line (None when no battery is known)."""
    levels = {
        str(d["device"]): level
        for d in fleet["devices"]
        if (level := _finite(d.get("battery"))) is not None
    }
    return {"round": fleet["round"], "batteries": levels} if levels else None


class FleetWriter(RoundCallback):
    """Round callback: rewrite ``run_dir/fleet.json`` after every round, and append the
    round's batteries to ``run_dir/batteries.jsonl``."""

    def __init__(self, run_dir: Path, stopping_tau: float | None = None) -> None:
        self.path = Path(run_dir) / FILENAME
        self.batteries = Path(run_dir) / BATTERIES
        self.stopping_tau = stopping_tau

    def after_round(self, result: RoundResult) -> str | None:
        fleet = snapshot(result, self.stopping_tau)
        atomic_write_text(self.path, json.dumps(fleet) + "\n")
        line = batteries_line(fleet)
        if line is not None:
            # One write of one whole line: a reader drops a last line cut short by a crash.
            with open_append(self.batteries) as f:  # never through a planted link
                f.write(json.dumps(line) + "\n")
        return None
