"""The closing output of ``edgefleet run``: the per-session table first, a line per technique,
the whole-test figure last and labelled (issue 17's demo that tells its story)."""

from __future__ import annotations

import json
from pathlib import Path

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
