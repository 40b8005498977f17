"""Tests for edgefleet.simulation.report on synthetic run folders (no Flower needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edgefleet.simulation.report import (
    ReportError,
    RunData,
    aux_rounds,
    draw_plots,
    load_run,
    main,
    session_spans,
    session_starts,
    summary_table,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(rnd: int, acc: float, session: int = 0, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "round": rnd,
        "session": session,
        "test_accuracy": acc,
        "test_loss": 2.0 - acc,
        "participants": [f"dev-{i}" for i in range(rnd % 3, 10, 2)],
        "declined": ["dev-1"],
        "bytes_up": 1_500_000,
        "bytes_down": 3_000_000,
        "energy_spent": 0.5 * rnd,
        "wall_s": 2.0 * rnd,
    }
    row.update(extra)
    return row


def _write_run(path: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _summary(rows: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    accs = [r["test_accuracy"] for r in rows]
    summary: dict[str, Any] = {
        "final_accuracy": accs[-1] if accs else 0.0,
        "best_accuracy": max(accs) if accs else 0.0,
        "rounds_run": len(rows),
        "stop_round": None,
        "stop_reason": "budget",
        "total_bytes_up": sum(r["bytes_up"] for r in rows),
        "total_bytes_down": sum(r["bytes_down"] for r in rows),
        "wall_s": rows[-1]["wall_s"] if rows else 0.0,
        "config": {"strategy": "fedavg", "dataset": "cifar10", "model": "cnn"},
    }
    summary.update(overrides)
    return summary


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """Three runs: one stopped early, one spanning sessions (with newer/missing keys), one empty."""
    early_rows = [_row(r, acc) for r, acc in enumerate([0.31, 0.52, 0.61, 0.6123, 0.6100], 1)]
    early = _write_run(
        tmp_path / "run-a",
        early_rows,
        _summary(early_rows, run_name="early-stop", stop_round=5, stop_reason="plateau"),
    )
    session_rows = [
        _row(r, 0.2 + 0.1 * r, session=(r - 1) // 2, rejected=["dev-3"], growth=1.1)
        for r in range(1, 7)
    ]
    del session_rows[2]["energy_spent"]  # optional keys may be missing
    sessions = _write_run(
        tmp_path / "sessions-run",
        session_rows,
        _summary(session_rows, config={"strategy": "fedprox", "dataset": "femnist"}),
    )
    empty = _write_run(tmp_path / "empty-run", [], _summary([], stop_reason="no_devices"))
    return {"early": early, "sessions": sessions, "empty": empty}


def test_load_run_parses(runs: dict[str, Path]) -> None:
    early = load_run(runs["early"])
    assert isinstance(early, RunData)
    assert early.name == "early-stop"  # run_name wins over the folder name
    assert early.path == runs["early"]
    assert [r["round"] for r in early.rows] == [1, 2, 3, 4, 5]
    assert early.summary["stop_reason"] == "plateau"

    sessions = load_run(str(runs["sessions"]))
    assert sessions.name == "sessions-run"  # no run_name: folder name
    assert sessions.rows[0]["rejected"] == ["dev-3"]  # unknown keys are kept, not rejected

    empty = load_run(runs["empty"])
    assert empty.rows == []
    assert empty.summary["rounds_run"] == 0


def test_load_run_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="nope"):
        load_run(tmp_path / "nope")


def test_load_run_missing_metrics(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(ReportError, match="metrics.jsonl"):
        load_run(tmp_path / "run")


def test_load_run_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    run = tmp_path / "bad"
    run.mkdir()
    lines = [json.dumps(_row(1, 0.1)), "{not json", json.dumps(_row(3, 0.3))]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl:2"):
        load_run(run)
    assert issubclass(ReportError, ValueError)


def test_truncated_last_row_keeps_the_others_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed while writing a row: the rows before it are reported."""
    run = tmp_path / "killed"
    run.mkdir()
    full = json.dumps(_row(3, 0.3))
    lines = [json.dumps(_row(1, 0.1)), json.dumps(_row(2, 0.2)), full[: len(full) // 2]]
    (run / "metrics.jsonl").write_text("\n".join(lines))  # no newline: cut mid-write
    data = load_run(run)
    assert [r["round"] for r in data.rows] == [1, 2]
    assert len(data.warnings) == 1 and "truncated last row" in data.warnings[0]
    assert main([str(run)]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "metrics.jsonl:3" in captured.err
    assert "killed" in captured.out


def test_rows_of_two_writers_are_refused_naming_the_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume started while the run still went (issue 26): both processes appended."""
    rounds = [*range(1, 8), *range(11, 20), 8, 9, 10, 11]
    rows = [_row(r, 0.01 * r) for r in rounds]
    run = _write_run(tmp_path / "two", rows, _summary(rows))
    metrics = run / "metrics.jsonl"
    with pytest.raises(ReportError) as err:
        load_run(run)
    assert str(err.value).startswith(
        f"{metrics}: rounds out of order or recorded twice (rounds 8, 9, 10, 11 (lines 17-20) "
        "after round 19 (line 16)): two processes wrote this run at once"
    )
    assert main([str(run)]) == 2
    assert "edgefleet report: error:" in capsys.readouterr().err
    assert not (run / "accuracy.png").exists()  # nothing plotted
    dup = [_row(1, 0.1), _row(2, 0.2), _row(2, 0.25), _row(3, 0.3)]
    with pytest.raises(ReportError, match=r"\(round 2 \(line 3\) after round 2 \(line 2\)\)"):
        load_run(_write_run(tmp_path / "dup", dup, _summary(dup)))


def test_a_resumed_runs_rows_and_gaps_are_fine(tmp_path: Path) -> None:
    """What a resume leaves (MetricsWriter.keep_until rewrites the rows up to the
    checkpoint, the rounds after it are appended) rises throughout; a round missing in
    between is no reason to refuse, nor is a row without a round number."""
    rows = [_row(r, 0.1 * r) for r in (1, 2, 3, 4, 5, 7)]
    rows.insert(2, {k: v for k, v in _row(0, 0.5).items() if k != "round"})
    data = load_run(_write_run(tmp_path / "resumed", rows, _summary(rows)))
    assert [r.get("round") for r in data.rows] == [1, 2, None, 3, 4, 5, 7]
    assert not data.warnings


def test_load_run_non_object_line(tmp_path: Path) -> None:
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl:1"):
        load_run(run)


def test_summary_table_has_names_and_figures(runs: dict[str, Path]) -> None:
    table = summary_table([load_run(p) for p in runs.values()])
    for name in ("early-stop", "sessions-run", "empty-run"):
        assert name in table
    for figure in ("fedavg", "fedprox", "femnist", "cifar10", "plateau", "budget", "no_devices"):
        assert figure in table
    assert "0.6123" in table  # best accuracy of the early run
    assert "0.6100" in table  # its final accuracy
    assert "7.50" in table  # 5 rounds x 1.5 MB up
    assert "18.00" in table  # 6 rounds x 3 MB down
    lines = table.splitlines()
    assert lines[0].startswith("run") and "stop reason" in lines[0]
    assert len(lines) == 2 + 3  # header, rule, one line per run


def test_draw_plots_writes_pngs(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "plots"
    paths = draw_plots([load_run(p) for p in runs.values()], out)
    names = {p.name for p in paths}
    assert names == {"accuracy.png", "communication.png", "energy.png", "participation.png"}
    for path in paths:
        assert path.parent == out
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 1000


def test_draw_plots_single_empty_run(runs: dict[str, Path], tmp_path: Path) -> None:
    paths = draw_plots([load_run(runs["empty"])], tmp_path / "out")
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in paths)


def test_main_prints_table_and_writes_plots(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report-out"
    assert main([str(runs["early"]), str(runs["sessions"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "early-stop" in printed and "sessions-run" in printed
    assert str(out / "accuracy.png") in printed
    assert (out / "participation.png").is_file()


def test_main_single_run_defaults_to_run_folder(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(runs["sessions"])]) == 0
    assert (runs["sessions"] / "accuracy.png").is_file()
    assert "sessions-run" in capsys.readouterr().out


def test_main_several_runs_default_to_report_dir(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([str(runs["early"]), str(runs["empty"])]) == 0
    assert (tmp_path / "report" / "energy.png").is_file()


def test_main_missing_folder_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "error" in err


def test_main_without_arguments_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


def _session_rows() -> list[dict[str, Any]]:
    """Three sessions of 3 rounds from round 1; sessions 2 and 3 open with one aux round."""
    rows = []
    for rnd in range(1, 10):
        session = (rnd - 1) // 3 + 1
        phase = "aux" if session > 1 and (rnd - 1) % 3 == 0 else "train"
        rows.append(_row(rnd, 0.3, session=session, phase=phase, session_accuracy=0.5 + 0.05 * rnd))
    return rows


def test_session_starts_finds_the_boundaries() -> None:
    rows = _session_rows()
    assert session_starts(rows) == [4, 7]
    assert aux_rounds(rows) == [4, 7]
    assert [(s, [r["round"] for r in span]) for s, span in session_spans(rows)] == [
        (1, [1, 2, 3]),
        (2, [4, 5, 6]),
        (3, [7, 8, 9]),
    ]
    # A resumed run may start mid-session; rows without a round number count by position.
    assert session_starts(rows[4:]) == [7]
    unnumbered = [{k: v for k, v in r.items() if k != "round"} for r in rows]
    assert session_starts(unnumbered) == [4, 7]
    # A session that comes back (A B A) is a boundary each time it changes.
    assert session_starts([_row(1, 0.1, 1), _row(2, 0.1, 2), _row(3, 0.1, 1)]) == [2, 3]


def test_session_starts_without_sessions() -> None:
    assert session_starts([]) == []
    assert session_starts([_row(1, 0.1)]) == []
    assert session_starts([_row(r, 0.1) for r in range(1, 5)]) == []  # session 0 throughout
    no_key = [{"round": r, "test_accuracy": 0.1} for r in range(1, 4)]
    assert session_starts(no_key) == []
    assert aux_rounds(no_key) == []
    assert len(session_spans(no_key)) == 1


def test_accuracy_plot_with_sessions(tmp_path: Path) -> None:
    rows = _session_rows()
    run = _write_run(tmp_path / "pilot", rows, _summary(rows))
    plain_rows = [_row(r, 0.1 * r) for r in range(1, 6)]
    plain = _write_run(tmp_path / "plain", plain_rows, _summary(plain_rows))
    paths = draw_plots([load_run(run), load_run(plain)], tmp_path / "out")
    accuracy = next(p for p in paths if p.name == "accuracy.png")
    assert accuracy.read_bytes().startswith(PNG_SIGNATURE)
    # session_accuracy gets a panel of its own; a run without it keeps the single panel.
    alone = draw_plots([load_run(plain)], tmp_path / "alone")[0]
    assert _png_height(accuracy) > 1.5 * _png_height(alone)


def _png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # IHDR: width, then height


def test_energy_off_is_said_and_the_accuracy_legend_sits_below_the_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import edgefleet.simulation.report as report

    figures: dict[str, Any] = {}

    def keep(fig: Any, path: Path) -> Path:
        figures[path.name] = fig
        fig.canvas.draw()  # lays the legend out, as saving would
        return path

    monkeypatch.setattr(report, "_save", keep)
    rows = [_row(r, 0.1 * r, session=1 + r // 3, energy_spent=0.0) for r in range(1, 7)]
    # A name as long as the demo's: beside the axes, its legend took half the figure's width.
    name = "demo-20261205-201500-fedsag-energy-age-pruning-sessions"
    summary = {**_summary(rows), "stop_round": 6, "stop_reason": "task-vector-plateau"}
    draw_plots([load_run(_write_run(tmp_path / name, rows, summary))], tmp_path / "out")
    (energy,) = figures["energy.png"].axes
    assert energy.get_ylim()[0] == 0.0  # a flat 0 lies on the axis, not in mid-air
    assert any("energy off" in t.get_text() for t in energy.texts)
    fig = figures["accuracy.png"]
    fig.tight_layout()  # as saving does
    fig.canvas.draw()
    acc = fig.axes[0]
    legend = fig.axes[-1].get_legend().get_window_extent()
    box, width = acc.get_window_extent(), fig.get_window_extent().width
    assert legend.y1 <= box.y0  # below the axes: covers no curve
    assert box.width >= 0.8 * width  # and leaves the plot the figure's width
    assert legend.x0 >= 0 and legend.x1 <= width  # all of it in the picture
    spent = [_row(r, 0.1 * r) for r in range(1, 4)]
    figures.clear()
    draw_plots([load_run(_write_run(tmp_path / "spent", spent, _summary(spent)))], tmp_path / "o2")
    assert not figures["energy.png"].axes[0].texts
