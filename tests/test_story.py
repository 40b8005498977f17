"""The closing output of ``edgefleet run``: the per-session table first, a line per technique,
the whole-test figure last and labelled (issue 17's demo that tells its story)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgefleet.config import DEFAULTS
from edgefleet.simulation.story import story


def _row(rnd: int, session: int, participants: list[str], **extra: object) -> dict[str, object]:
    return {
        "round": rnd,
        "session": session,
        "test_accuracy": 0.3,
        "participants": participants,
        "declined": [],
        "rejected": [],
        "bytes_up": 1_000_000,
        "bytes_down": 1_000_000,
        "energy_spent": 4.0 * len(participants),
        **extra,
    }


def _write(tmp_path: Path) -> Path:
    config = {
        **DEFAULTS,
        "strategy": "fedsag",
        "selection.mode": "energy-age",
        "selection.max-devices": 2,
        "warmstart.mode": "pilot",
        "warmstart.pilot-sessions": 1,
        "sessions.schedule": "alternate",
        "stopping.mode": "data-free",
        "pruning.keep-ratios": "1.0,0.5",
    }
    rows = [
        _row(1, 1, ["0", "2"], compact_replies=1, mean_kept_fraction=0.6),
        _row(2, 1, ["0"], selected=["0"], compact_replies=0, mean_kept_fraction=1.0),
        _row(3, 2, ["1", "3"], phase="aux"),
        _row(4, 2, ["1"], warmstart_weights=[]),
        _row(5, 3, ["0", "2"], phase="aux", warm_start=True, warmstart_weights={"2": 0.99}),
        _row(6, 3, [], stopping_resting=True),
    ]
    sessions = [
        {"session": s, "start_round": start, "rounds": 2, "aux_rounds": int(s > 1),
         "rounds_to_target": target, "final_session_accuracy": acc, "bytes": 4e6,
         "energy_spent": 8.0}
        for s, start, target, acc in ((1, 1, 2, 0.85), (2, 3, None, 0.6), (3, 5, 1, 0.9))
    ]  # fmt: skip
    summary = {
        "run_name": "demo",
        "rounds_run": 6,
        "stop_reason": "budget",
        "stop_round": None,
        "wall_s": 12.0,
        "final_accuracy": 0.31,
        "best_accuracy": 0.45,
        "target_accuracy": 0.8,
        "sessions": sessions,
        "config": config,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_story_leads_with_sessions_then_techniques_then_the_labelled_whole_test(
    tmp_path: Path,
) -> None:
    text = story(_write(tmp_path))
    lines = text.splitlines()
    table = lines.index(next(line for line in lines if line.strip().startswith("session")))
    assert table < text.index("What each technique did") < text.index("Whole-test-set")
    session3 = next(line for line in lines if line.strip().startswith("3 "))
    assert "0 2" in session3 and "warm: 0.99 on session 2 (of 1 stored)" in session3
    assert " 1 " in session3 and "0.90" in session3  # reached the target in 1 round
    assert "no stored look-alike yet" in text  # session 2, the first post-pilot one
    assert "at most 2 devices a round" in text and "SAGA server memory" in text
    assert "1 of 8 replies were curvature-pruned" in text
    assert "rested for 1 rounds" in text and "sessions 3" in text
    assert "so this stays low by design): final 0.310, best 0.450" in text


def _sessions_run(tmp_path: Path, second: list[float], stop: str = "budget") -> str:
    """Session 1 from scratch (0.5 then 0.7), session 2 warm-started with ``second``."""
    config = {**DEFAULTS, "warmstart.mode": "previous", "sessions.schedule": "alternate",
              "stopping.mode": "data-free", "num-server-rounds": 8}  # fmt: skip
    curve = [(1, 0.5), (1, 0.7)] + [(2, a) for a in second]
    rows = [_row(i + 1, s, ["0"], session_accuracy=a) for i, (s, a) in enumerate(curve)]
    sessions = [
        {"session": s, "start_round": 1 if s == 1 else 3, "rounds": n, "aux_rounds": 0,
         "rounds_to_target": None, "final_session_accuracy": 0.7, "bytes": 0, "energy_spent": 0}
        for s, n in ((1, 2), (2, len(second)))
    ]  # fmt: skip
    summary = {"run_name": "r", "rounds_run": len(rows), "stop_reason": stop, "stop_round": None,
               "wall_s": 1.0, "final_accuracy": 0.3, "best_accuracy": 0.3,
               "target_accuracy": 0.8, "sessions": sessions, "config": config}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return story(tmp_path)


def test_the_story_says_whether_warm_start_and_stopping_helped(tmp_path: Path) -> None:
    text = _sessions_run(tmp_path, [0.72, 0.8])
    assert "Did it help?" in text
    assert "session 1 from scratch (0.70 on its classes after 2 round(s))" in text
    assert "session 2 reached it in 1 round(s) (1 fewer: helped)" in text
    assert "Data-free stopping never fired" in text and "all 4 rounds ran" in text
    text = _sessions_run(tmp_path, [0.4, 0.6])
    assert "did not reach it in 2 round(s); after 2 round(s) it had 0.60 against" in text
    assert "session 1's 0.70 (did not help)" in text
    text = _sessions_run(tmp_path, [0.4, 0.7], stop="task-vector-plateau")
    assert "reached it in 2 round(s) (as many: no gain)" in text
    assert "Data-free stopping saved 4 of 8 rounds not run" in text


def test_edgefleet_run_report_prints_the_story_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make demo`` (``edgefleet run ... --report``) printed the whole story twice: once
    after the run, once more from the report."""
    from edgefleet import cli
    from edgefleet.simulation import runner

    (tmp_path / "run").mkdir()
    run_dir = _write(tmp_path / "run")
    monkeypatch.setattr(cli, "_early_engine", lambda *a: None)
    monkeypatch.setattr(runner, "run_scenario", lambda *a, **k: run_dir)
    scenario = str(Path(__file__).resolve().parents[1] / "scenarios" / "fedavg.toml")
    assert cli.main(["run", scenario, "--report", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("What each technique did") == 1, out
    assert "wrote " in out  # the report's plots
