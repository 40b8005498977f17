"""Run results on disk: ``metrics.jsonl`` (a row per round) and ``summary.json``.

Rows are appended and flushed as each round ends, so a crashed run still leaves every
finished round behind; ``summary.json`` is written once at the end, atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any, TypeVar

from flwr.common import log

from edgefleet import runlock
from edgefleet.config import RunConfig
from edgefleet.fileio import atomic_write_text, open_append, read_regular
from edgefleet.loop.context import (
    PruningRow,
    RobustRow,
    ScreeningRow,
    SelectionRow,
    SessionRow,
    StoppingRow,
    TelemetryRow,
    ValidationRow,
)
from edgefleet.loop.roundloop import LoopOutcome, RoundCallback, RoundResult
from edgefleet.server.checkpoint import check_resumable
from edgefleet.wire import TRAIN_LOSS

S = TypeVar("S")

# Every component's row section (edgefleet.loop.context); a column belongs to exactly
# one (tests/test_results_rows.py), so a row can be read back into them.
SECTIONS: tuple[type, ...] = (
    ScreeningRow,
    TelemetryRow,
    SelectionRow,
    SessionRow,
    PruningRow,
    RobustRow,
    StoppingRow,
    ValidationRow,
)


def default_run_name(cfg: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{cfg.server.strategy}-{cfg.data.dataset}-s{cfg.seed}"


class RunDirError(ValueError):
    """``output-dir`` cannot hold the run's folder; the message says why."""


def prepare_run_dir(cfg: RunConfig, *, lock: bool = True) -> Path:
    """Create ``output-dir/run-name``; refuse one that already holds results unless the run
    is to be resumed (``resume = true``), and a resume that would not continue the same run
    (:func:`~edgefleet.server.checkpoint.check_resumable`). An output-dir that cannot hold
    the folder (a file, no permission, a read-only disk) is a :class:`RunDirError` naming
    it, before any work is spent.

    A folder that another process writes is refused first (:class:`~edgefleet.runlock.
    RunLocked`). With ``lock`` (the ServerApp) this process then holds the folder's writer
    lock until :func:`edgefleet.runlock.release` or its end; without it (the runner, before
    Flower starts) the lock is only checked."""
    if cfg.server.resume and not cfg.server.run_name:
        raise ValueError("resume = true needs the run-name of the run to continue")
    output = Path(cfg.server.output_dir)
    run_dir = output / (cfg.server.run_name or default_run_name(cfg))
    runlock.check(run_dir)  # before its results are judged: they may be still growing
    if cfg.server.resume:
        check_resumable(cfg, run_dir)
    elif (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"run folder {run_dir} already holds results; choose another run-name, remove it, "
            "or continue it with resume = true in the run config (`edgefleet run SCENARIO "
            "--set run-name=NAME --resume` on the command line)"
        )
    else:
        _make_run_dir(output, run_dir)
    if lock:
        runlock.acquire(run_dir)
    return run_dir


def _make_run_dir(output: Path, run_dir: Path) -> None:
    try:
        output.mkdir(parents=True, exist_ok=True)
        try:
            # Exclusively: a folder someone else made, or filled with links, beforehand
            # is not where a new run starts.
            run_dir.mkdir()
        except FileExistsError:
            _check_fresh(run_dir)
        with tempfile.TemporaryFile(dir=run_dir):
            pass  # the folder exists; can we write in it?
    except OSError as err:
        why = err.strerror or type(err).__name__
        blocker = next((p for p in (output, *output.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            why = f"{blocker} is a file, not a folder"
        raise RunDirError(
            f"output-dir {str(output)!r} cannot hold the run folder {run_dir.name!r}: {why}. "
            "Choose another output-dir (--set output-dir=...)."
        ) from None


def _check_fresh(run_dir: Path) -> None:
    """An existing folder a new run may start in: this user's own, a real folder (not a link
    to one) and empty but for its writer lock, whose own rules judge it (:mod:`~edgefleet.
    runlock`). (``edgefleet run`` makes the folder before the ServerApp, which prepares it
    again, starts: it finds it so.) Anything else is a :class:`RunDirError`."""
    st = run_dir.lstat()
    if stat.S_ISLNK(st.st_mode):
        why = f"is a symbolic link (to {os.readlink(run_dir)}), not a folder this run made"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is a file, not a folder"
    elif st.st_uid != os.getuid():
        why = f"belongs to another user (uid {st.st_uid}), who could plant files in it"
    elif held := sorted(p.name for p in run_dir.iterdir() if p.name != runlock.LOCK_FILE):
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        why = f"already holds {shown} (a run that ended before its first row?)"
    else:
        return
    raise RunDirError(
        f"run folder {run_dir} {why}: a new run starts in a new folder. Choose another "
        "run-name (--set run-name=...), remove it, or continue an interrupted run there "
        "with --resume."
    )


def round_row(result: RoundResult) -> dict[str, Any]:
    row: dict[str, Any] = {
        "round": result.round,
        "session": result.session,
        "test_accuracy": result.eval_metrics.get("test_accuracy"),
        "test_loss": result.eval_metrics.get("test_loss"),
        "test_balanced_accuracy": result.eval_metrics.get("test_balanced_accuracy"),
        "participants": result.participants,
        "declined": result.declined,
        "unreachable": result.unreachable,
        "rejected": result.rejected,
        "bytes_up": result.bytes_up,
        "bytes_down": result.bytes_down,
        "energy_spent": result.energy_spent,
        "wall_s": round(result.wall_s, 3),
        "train_loss": result.train_metrics.get(TRAIN_LOSS),
        # False in a round between central evaluations (evaluate-every > 1): the test
        # figures are then None, not the last round's repeated.
        "evaluated": result.evaluated,
    }
    if result.federated_metrics:
        row["federated"] = result.federated_metrics
    # Each component's typed section (edgefleet.loop.context), then any column a
    # callback of the user's own added.
    row.update(result.context.columns())
    row.update(result.extra)
    return row


class MetricsWriter(RoundCallback):
    """Round callback: append one JSON row per round to ``metrics.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        # A resumed run's loop clock starts at zero: its rows and summary add the time the
        # parts before it ran (the last kept row's wall_s), so wall_s covers every part.
        self.wall_offset = 0.0

    def keep_until(self, last_round: int) -> None:
        """On resume: keep the rows of rounds up to ``last_round`` (the checkpoint's); a row
        written after it belongs to a round that will run again. A last row cut short (the
        server died while writing it) is dropped with a warning; an unreadable row before
        the last is an error (the file was damaged otherwise)."""
        if not self.path.exists():
            return
        rows = read_rows(self.path)
        self.rows = [r for r in rows if r["round"] <= last_round]
        walls = [r.get("wall_s") for r in self.rows]
        self.wall_offset = max((float(w) for w in walls if isinstance(w, int | float)), default=0.0)
        if len(self.rows) < last_round:
            log(
                WARNING,
                "%s holds %d rows up to the checkpoint's round %d: some rows are missing",
                self.path,
                len(self.rows),
                last_round,
            )
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def after_round(self, result: RoundResult) -> str | None:
        row = round_row(result)
        row["wall_s"] = round(row["wall_s"] + self.wall_offset, 3)
        self.rows.append(row)
        with open_append(self.path) as f:  # never through a planted link
            f.write(json.dumps(row) + "\n")
            f.flush()
        return None


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; a cut-short last line is left out (logged)."""
    lines = read_regular(path).decode().splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("round"), int):
                raise ValueError("not a row with a round number")
        except ValueError as err:
            if i == len(lines) - 1:
                log(WARNING, "%s: dropping its last row, which is incomplete (%s)", path, err)
                continue
            raise ValueError(f"{path} line {i + 1} is not a metrics row ({err})") from None
        rows.append(row)
    return rows


@dataclass(frozen=True)
class MetricsRow:
    """One ``metrics.jsonl`` row read back, typed: the loop's own columns (:func:`round_row`),
    each component's section as its dataclass (:meth:`section`), and any other column (one a
    callback of a user's own added) in ``extra``. Readers use this, not column strings, so a
    renamed column fails in one place."""

    round: int
    session: int = 1
    test_accuracy: float | None = None
    test_loss: float | None = None
    test_balanced_accuracy: float | None = None
    participants: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # absent in rows before issue 42
    rejected: list[dict[str, str]] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    energy_spent: float = 0.0
    wall_s: float = 0.0
    train_loss: float | None = None
    evaluated: bool = True
    federated: dict[str, float] = field(default_factory=dict)
    sections: dict[type, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def section(self, cls: type[S]) -> S | None:
        """The row's section of type ``cls``; None when that component was off this round."""
        found: S | None = self.sections.get(cls)
        return found

    def of(self, cls: type[S]) -> S:
        """The row's section of type ``cls``, or its defaults when the component was off (a
        run without sessions reads as phase ``train``, no session accuracy)."""
        found: S | None = self.sections.get(cls)
        return cls() if found is None else found

    @classmethod
    def parse(cls, row: Mapping[str, Any]) -> MetricsRow:
        own = {f.name for f in dataclasses.fields(cls)} - {"sections", "extra"}
        sections: dict[type, Any] = {}
        taken = set(own)
        for section in SECTIONS:
            names = {f.name for f in dataclasses.fields(section)}
            present = {k: row[k] for k in names if k in row}
            if present:
                sections[section] = section(**present)
            taken |= names
        # A column written as null reads as the field's default (read_rows has checked round).
        return cls(
            **{k: row[k] for k in own if row.get(k) is not None},
            sections=sections,
            extra={k: v for k, v in row.items() if k not in taken},
        )


def read_metrics(path: Path) -> list[MetricsRow]:
    """:func:`read_rows`, each row typed (:class:`MetricsRow`)."""
    return [MetricsRow.parse(r) for r in read_rows(path)]


def session_summary(
    rows: list[dict[str, Any]] | list[MetricsRow], target: float
) -> list[dict[str, Any]]:
    """Per session: its rounds (auxiliary ones included), bytes and energy spent, the last
    accuracy on the session's classes, and the rounds from the session's start until that
    accuracy first reaches ``target`` (auxiliary rounds counted as spent; None = never).
    An auxiliary row counts only when it evaluated the warm-start model (its last one):
    the earlier ones evaluate aux results, which the session does not start from."""
    typed = [r if isinstance(r, MetricsRow) else MetricsRow.parse(r) for r in rows]
    out: list[dict[str, Any]] = []
    for session in sorted({r.session for r in typed if r.session}):
        mine = [r for r in typed if r.session == session]
        parts = [r.of(SessionRow) for r in mine]
        reached = next(
            (i + 1 for i, p in enumerate(parts)
             if p.session_accuracy is not None and p.session_accuracy >= target
             and (p.phase != "aux" or p.warm_start)),
            None,
        )  # fmt: skip
        out.append(
            {
                "session": session,
                "start_round": mine[0].round,
                "rounds": len(mine),
                "aux_rounds": sum(p.phase == "aux" for p in parts),
                "rounds_to_target": reached,
                "final_session_accuracy": parts[-1].session_accuracy,
                "bytes": sum(r.bytes_up + r.bytes_down for r in mine),
                "energy_spent": sum(r.energy_spent for r in mine),
            }
        )
    return out


def write_summary(
    run_dir: Path,
    cfg: RunConfig,
    outcome: LoopOutcome,
    rows: list[dict[str, Any]],
    wall_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json``; ``extra`` adds keys or overrides computed ones."""
    evaluated = [r for r in rows if r["test_accuracy"] is not None]
    accs = [r["test_accuracy"] for r in evaluated]
    # A run stopped between central evaluations had its final model evaluated apart.
    final = outcome.final_eval.get("test_accuracy", accs[-1] if accs else None)
    summary = {
        "run_name": run_dir.name,
        "final_accuracy": final,
        "best_accuracy": max(accs) if accs else None,
        "best_round": evaluated[accs.index(max(accs))]["round"] if accs else None,
        "rounds_run": len(rows),
        "stop_round": outcome.stop_round,
        "stop_reason": outcome.stop_reason,
        "total_bytes_up": sum(r["bytes_up"] for r in rows),
        "total_bytes_down": sum(r["bytes_down"] for r in rows),
        "total_energy_spent": sum(r["energy_spent"] for r in rows),
        "wall_s": round(wall_s, 3),
        "config": cfg.to_dict(),
    }
    if any(r.get("session") for r in rows):
        summary["target_accuracy"] = cfg.sessions.target_accuracy
        summary["sessions"] = session_summary(rows, cfg.sessions.target_accuracy)
    summary.update(extra or {})
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
