"""A run's progress in the terminal, read from its ``metrics.jsonl`` as rounds land.

The line (``round 3/30 | session 2 | acc 0.612 | rejected 1 | growth 0.0123, plateau 2 |
ETA 1m20s``; the growth part only with data-free stopping) is made from the
run folder's rows alone, so it shows a simulated run and a deployed one alike: whatever
writes the rows, :class:`ProgressReporter` follows the file. On a terminal it is one line
kept at the bottom (tqdm), with Flower's log scrolling above it (:meth:`ProgressReporter.
echo` writes that log through tqdm, so neither tears the other); when the output is not a
terminal (a CI log, a pipe) or with ``--quiet``, it is a plain line per round instead.

The ETA is the mean time of the last rounds times the rounds left in the budget: an
upper bound when data-free stopping may end the run early. A row's ``wall_s`` is the time
since the run started, so a round's own time is the difference from the row before.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from tqdm import tqdm

LIVE, PLAIN = "live", "plain"
ETA_ROUNDS = 10  # rounds the ETA averages over: recent rounds say most about the next


def display_mode(isatty: bool, quiet: bool) -> str:
    """``live`` (one line redrawn in place) on a terminal, else ``plain`` (a line per
    round); ``--quiet`` asks for plain lines even on a terminal."""
    return LIVE if isatty and not quiet else PLAIN


@dataclass
class RunProgress:
    """What the rows so far say about the run."""

    total: int  # the round budget
    round: int = 0
    session: int | None = None
    accuracy: float | None = None  # the last evaluated round's test accuracy
    rejected: int = 0
    walls: list[float] = field(default_factory=list)  # recent rounds' own times (s)
    wall: float = 0.0  # the last row's wall_s: seconds since the run started
    growth: float | None = None  # the task vector's last growth (data-free stopping)
    plateau: int | None = None  # its plateau counter; None: no stopping rule in the rows

    def add(self, row: dict[str, Any]) -> None:
        self.round = int(row.get("round", self.round + 1))
        if row.get("session"):
            self.session = int(row["session"])
        acc = row.get("test_accuracy")
        if isinstance(acc, int | float) and math.isfinite(acc):
            self.accuracy = float(acc)
        self.rejected += len(row.get("rejected") or [])
        wall = row.get("wall_s")
        if isinstance(wall, int | float) and math.isfinite(wall) and wall >= 0:
            # A clock that went back (rows of an older run without the resumed offset)
            # starts again from zero.
            own = wall - self.wall if wall >= self.wall else float(wall)
            self.walls = [*self.walls, own][-ETA_ROUNDS:]
            self.wall = float(wall)
        if "plateau_count" in row:
            plateau, growth = row.get("plateau_count"), row.get("task_vector_growth")
            self.plateau = int(plateau) if isinstance(plateau, int | float) else self.plateau
            ok = isinstance(growth, int | float) and not isinstance(growth, bool)
            self.growth = float(growth) if ok else None  # type: ignore[arg-type]

    def eta_s(self) -> float | None:
        if not self.walls:
            return None
        return statistics.fmean(self.walls) * max(0, self.total - self.round)


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(p: RunProgress) -> str:
    """``round 3/30 | session 2 | acc 0.612 | rejected 1 | growth 0.0123, plateau 2 |
    ETA 1m20s``; a part the rows do not have (no session, no evaluation, no stopping rule)
    is left out or shown as ``-``."""
    parts = [f"round {p.round}/{p.total}"]
    if p.session is not None:
        parts.append(f"session {p.session}")
    parts.append(f"acc {'-' if p.accuracy is None else f'{p.accuracy:.3f}'}")
    parts.append(f"rejected {p.rejected}")
    if p.plateau is not None:
        parts.append(
            f"growth {'-' if p.growth is None else f'{p.growth:.4g}'}, plateau {p.plateau}"
        )
    eta = p.eta_s()
    parts.append(f"ETA {'-' if eta is None else duration(eta)}")
    return " | ".join(parts)


class RowTail:
    """The complete rows appended to ``metrics.jsonl`` since the last read (a half-written
    last line waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.restarts = 0  # times the file was rewritten shorter (read again from the top)

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        if len(data) == 0 and self.path.stat().st_size < self.offset:
            self.offset = 0  # rewritten (a resume keeps its rows up to the checkpoint)
            self.restarts += 1
            return self.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a damaged row: the report says so, the progress line need not
            if isinstance(row, dict):
                rows.append(row)
        return rows


class ProgressReporter:
    """Follows ``run_dir/metrics.jsonl`` and shows :func:`progress_line` on ``stream``:
    redrawn in place (``live``) or a plain line per round. Call :meth:`poll` as often as
    convenient and :meth:`close` at the end."""

    def __init__(self, run_dir: Path, total: int, stream: TextIO, mode: str) -> None:
        self.tail = RowTail(Path(run_dir) / "metrics.jsonl")
        self.progress = RunProgress(total)
        self.stream, self.mode = stream, mode
        self.bar: tqdm[Any] | None = None
        if mode == LIVE:
            self.bar = tqdm(total=total, file=stream, bar_format="{desc}", leave=True)
            self.bar.set_description_str(f"round 0/{total} | waiting for the first round")

    def poll(self) -> None:
        restarts = self.tail.restarts
        rows = self.tail.read()
        if self.tail.restarts != restarts:
            self.progress = RunProgress(self.progress.total)
        for row in rows:
            self.progress.add(row)
            if self.bar is None:
                print(progress_line(self.progress), file=self.stream, flush=True)
        if rows and self.bar is not None:
            self.bar.set_description_str(progress_line(self.progress))

    def echo(self, text: str) -> None:
        """Write log output above the live line (or straight through when plain)."""
        if self.bar is None:
            self.stream.write(text)
            self.stream.flush()
        else:
            tqdm.write(text.rstrip("\n"), file=self.stream)

    def close(self) -> None:
        self.poll()
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def start_progress(
    run_dir: Path, total: int, mode: str | None, stream: TextIO, echo: TextIO | None
) -> tuple[ProgressReporter | None, TextIO | None]:
    """The reporter for ``mode`` (None: no progress line, no reporter) and the stream the
    run's log is to be echoed to: through the reporter, so that it scrolls above the live
    line instead of through it."""
    if mode is None:
        return None, echo
    reporter = ProgressReporter(run_dir, total, stream, mode)
    return reporter, None if echo is None else cast(TextIO, EchoThrough(reporter))


class EchoThrough(io.TextIOBase):
    """A text stream for Flower's log that writes through a :class:`ProgressReporter`."""

    def __init__(self, reporter: ProgressReporter) -> None:
        super().__init__()
        self.reporter = reporter

    def write(self, text: str) -> int:
        self.reporter.echo(text)
        return len(text)

    def flush(self) -> None:
        self.reporter.stream.flush()
