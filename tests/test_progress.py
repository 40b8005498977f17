"""The progress line of ``edgefleet run``: made from metrics.jsonl's rows, redrawn in place
on a terminal, a plain line per round otherwise (pure functions and a file; no Flower)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from edgefleet.simulation.progress import (
    LIVE,
    PLAIN,
    EchoThrough,
    ProgressReporter,
    RowTail,
    RunProgress,
    display_mode,
    duration,
    progress_line,
)


def _row(rnd: int, **extra: object) -> dict[str, object]:
    """A row as the ServerApp writes it: ``wall_s`` is the time since the start (2 s a round)."""
    return {"round": rnd, "session": 1, "test_accuracy": 0.5, "rejected": [],
            "wall_s": 2.0 * rnd, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("isatty", "quiet", "mode"),
    [(True, False, LIVE), (True, True, PLAIN), (False, False, PLAIN), (False, True, PLAIN)],
)
def test_live_only_on_a_terminal_without_quiet(isatty: bool, quiet: bool, mode: str) -> None:
    assert display_mode(isatty, quiet) == mode


def test_the_line_says_round_session_accuracy_rejections_and_eta() -> None:
    p = RunProgress(total=30)
    assert progress_line(p) == "round 0/30 | acc - | rejected 0 | ETA -"
    p.add(_row(1, session=0, test_accuracy=None, rejected=[{"device": "3", "reason": "x"}]))
    assert progress_line(p) == "round 1/30 | acc - | rejected 1 | ETA 58s"  # 29 left x 2 s
    p.add(_row(2, session=2, test_accuracy=0.6123, wall_s=6.0))  # this round took 4 s
    assert progress_line(p) == "round 2/30 | session 2 | acc 0.612 | rejected 1 | ETA 1m24s"
    p.add(_row(3, test_accuracy=float("nan"), wall_s="slow"))  # a bad value changes nothing
    assert p.accuracy == 0.6123 and p.walls == [2.0, 4.0]
    assert (duration(59.4), duration(61), duration(7620)) == ("59s", "1m01s", "2h07m")


def test_eta_is_the_rounds_left_times_a_rounds_own_time_not_the_time_since_the_start() -> None:
    """The issue's run: 12 of 30 rounds in 13.2 s (1.1 s a round) has about 20 s left; the
    time since the start taken as a round's time said 2m28s."""
    p = RunProgress(total=30)
    for r in range(1, 13):
        p.add(_row(r, wall_s=1.1 * r))
    assert progress_line(p).endswith("ETA 20s")


def test_the_line_shows_the_stopping_rules_growth_when_the_rows_have_it() -> None:
    p = RunProgress(total=30)
    p.add(_row(1, task_vector_growth=None, plateau_count=0))
    line = progress_line(p)
    assert line == "round 1/30 | session 1 | acc 0.500 | rejected 0 | growth -, plateau 0 | ETA 58s"
    p.add(_row(2, task_vector_growth=0.01234567, plateau_count=1))
    assert "| growth 0.01235, plateau 1 |" in progress_line(p)


def test_the_tail_reads_complete_rows_once_and_restarts_on_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = RowTail(path)
    assert tail.read() == []  # no file yet
    path.write_text(json.dumps(_row(1)) + "\n" + '{"round": 2, "ses')
    assert [r["round"] for r in tail.read()] == [1]
    with path.open("a") as f:
        f.write('sion": 1}\n')
    assert [r["round"] for r in tail.read()] == [2] and tail.read() == []
    path.write_text("")  # a resume rewrote it shorter
    assert tail.read() == [] and tail.restarts == 1


def test_plain_mode_prints_a_line_per_round_and_log_passes_through(tmp_path: Path) -> None:
    out = io.StringIO()
    reporter = ProgressReporter(tmp_path, 3, out, PLAIN)
    EchoThrough(reporter).write("INFO : [ROUND 1]\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(2)) + "\n")
    reporter.poll()
    reporter.close()
    assert out.getvalue().splitlines() == [
        "INFO : [ROUND 1]",
        "round 1/3 | session 1 | acc 0.500 | rejected 0 | ETA 4s",
        "round 2/3 | session 1 | acc 0.500 | rejected 0 | ETA 2s",
    ]


def test_live_mode_redraws_one_line_with_the_log_above_it(tmp_path: Path) -> None:
    out = io.StringIO()
    reporter = ProgressReporter(tmp_path, 3, out, LIVE)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    reporter.poll()
    EchoThrough(reporter).write("INFO : [ROUND 2]\n")
    reporter.close()
    text = out.getvalue()
    assert "\r" in text and "round 1/3 | session 1" in text  # redrawn in place
    assert "INFO : [ROUND 2]\n" in text
    assert text.rstrip().endswith("round 1/3 | session 1 | acc 0.500 | rejected 0 | ETA 4s")
