"""Turn EdgeFleet run folders into a text summary and a few PNG plots.

A run folder holds ``metrics.jsonl`` (one JSON object per round) and ``summary.json``.
Usage: ``edgefleet report RUN_DIR [RUN_DIR ...] [--out DIR] [--group]``.

A sweep folder (``edgefleet sweep``, it holds ``sweep.json``) stands for its runs, grouped by
grid point: the table gives each point's mean and standard deviation over its seeds, and
``accuracy.png`` its mean accuracy per round with the seeds' range shaded. ``--group`` groups
any runs the same way (runs whose configs differ only in the seed).

A run killed mid-write may end in a truncated row: the rows before it are kept, with a
warning. Rounds out of order or recorded twice are refused: EdgeFleet writes each round
once, in order (a resume rewrites the file up to its checkpoint first), so such a file was
written by two processes at once and no row of it can be trusted.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

# Reports are made on headless machines and in CI: never try to open a window.
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

MB = 1e6  # decimal megabytes, the unit used in the table and the plots


class ReportError(ValueError):
    """A run folder is missing or cannot be parsed."""


@dataclass
class RunData:
    path: Path
    name: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def load_run(run_dir: str | Path) -> RunData:
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: not a run folder (no such directory)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{metrics}: missing metrics file")
    rows: list[dict[str, Any]] = []
    linenos: list[int] = []
    warnings: list[str] = []
    lines = metrics.read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == last:  # a run killed while writing its last row
                warnings.append(
                    f"{metrics}:{lineno}: truncated last row ({exc.msg}) left out; "
                    f"the {len(rows)} rows before it are kept"
                )
                break
            raise ReportError(f"{metrics}:{lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ReportError(f"{metrics}:{lineno}: expected a JSON object per line")
        rows.append(row)
        linenos.append(lineno)
    problem = _round_order_problem(rows, linenos)
    if problem:
        raise ReportError(
            f"{metrics}: rounds out of order or recorded twice ({problem}): two processes "
            "wrote this run at once (a resume started while it still ran?), so its rows "
            "cannot be trusted; run it again under a new run-name"
        )
    # A run that crashed may have rounds but no summary; report what it has.
    summary: dict[str, Any] = {}
    summary_file = path / "summary.json"
    if summary_file.is_file():
        try:
            loaded = json.loads(summary_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{summary_file}:{exc.lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(loaded, dict):
            raise ReportError(f"{summary_file}: expected a JSON object")
        summary = loaded
    name = str(summary.get("run_name") or path.resolve().name)
    return RunData(path=path, name=name, rows=rows, summary=summary, warnings=warnings)


def _round_order_problem(rows: list[dict[str, Any]], linenos: list[int]) -> str:
    """Where the round numbers fail to rise, e.g. ``"rounds 8, 9, 11 (lines 17-19) after
    round 19 (line 16)"``; empty when they rise throughout (gaps allowed). Rows without a
    round number are not judged."""
    late: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (top, its line) -> (round, line)
    top: tuple[int, int] | None = None
    for row, lineno in zip(rows, linenos, strict=True):
        rnd = row.get("round")
        if not isinstance(rnd, int):
            continue
        if top is not None and rnd <= top[0]:
            late.setdefault(top, []).append((rnd, lineno))
        else:
            top = (rnd, lineno)
    parts = []
    for (rnd, lineno), after in late.items():
        rounds = ", ".join(str(r) for r, _ in after[:8])
        rounds += f", ... ({len(after)} in all)" if len(after) > 8 else ""
        lines = f"{after[0][1]}-{after[-1][1]}" if len(after) > 1 else str(after[0][1])
        noun = "rounds" if len(after) > 1 else "round"
        parts.append(f"{noun} {rounds} (line{'s' * (len(after) > 1)} {lines}) after round "
                     f"{rnd} (line {lineno})")  # fmt: skip
    return "; ".join(parts)


# ---------------------------------------------------------------- table


def _fmt(value: Any, spec: str) -> str:
    if value is None or value == "":
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _table_row(run: RunData) -> list[str]:
    s, rows = run.summary, run.rows
    config: dict[str, Any] = s["config"] if isinstance(s.get("config"), dict) else {}
    accs = [r["test_accuracy"] for r in rows if r.get("test_accuracy") is not None]
    # Fall back to the per-round rows so a run without summary.json still shows figures.
    final = s.get("final_accuracy", accs[-1] if accs else None)
    best = s.get("best_accuracy", max(accs) if accs else None)
    up = s.get("total_bytes_up", sum(r.get("bytes_up", 0) for r in rows))
    down = s.get("total_bytes_down", sum(r.get("bytes_down", 0) for r in rows))
    wall = s.get("wall_s", rows[-1].get("wall_s") if rows else None)
    return [
        run.name,
        _fmt(config.get("strategy"), ""),
        _fmt(config.get("dataset"), ""),
        _fmt(s.get("rounds_run", len(rows)), "d"),
        _fmt(final, ".4f"),
        _fmt(best, ".4f"),
        _fmt(s.get("stop_round"), "d"),
        _fmt(s.get("stop_reason"), ""),
        _fmt(up / MB if isinstance(up, int | float) else None, ".2f"),
        _fmt(down / MB if isinstance(down, int | float) else None, ".2f"),
        _fmt(wall, ".1f"),
    ]


_HEADERS = ["run", "strategy", "dataset", "rounds", "final acc", "best acc", "stop round"]
_HEADERS += ["stop reason", "MB up", "MB down", "wall s"]
_TEXT_COLUMNS = {0, 1, 2, 7}  # left-aligned; the numbers are right-aligned so digits line up


def summary_table(runs: list[RunData]) -> str:
    table = [_HEADERS] + [_table_row(run) for run in runs]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEADERS))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i in _TEXT_COLUMNS else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(table[0]), rule] + [line(row) for row in table[1:]])


# ---------------------------------------------------------------- groups of seeds

# Keys that name or place a run, or that a group averages over: not what tells points apart.
_NOT_SETTINGS = ("seed", "run-name", "output-dir", "data-dir", "resume")


@dataclass
class Group:
    """Runs of one setting with different seeds (a sweep's grid point)."""

    label: str
    runs: list[RunData]


def _settings(run: RunData) -> dict[str, Any]:
    config = run.summary.get("config")
    if not isinstance(config, dict):
        return {"run": run.name}  # no summary: a group of its own
    return {k: v for k, v in config.items() if k not in _NOT_SETTINGS}


def group_runs(runs: list[RunData], labels: dict[Path, str] | None = None) -> list[Group]:
    """Runs grouped by setting, in first-seen order. ``labels`` (run folder -> name, e.g. a
    sweep's grid points) decides the groups when given; otherwise runs whose configs differ
    only in the seed form a group, labelled by the settings that tell the groups apart."""
    keyed: dict[str, list[RunData]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for run in runs:
        if labels is not None:
            key = labels.get(run.path.resolve(), run.name)
        else:
            key = json.dumps(_settings(run), sort_keys=True, default=str)
        keyed.setdefault(key, []).append(run)
        settings.setdefault(key, _settings(run))
    if labels is not None:
        return [Group(k, v) for k, v in keyed.items()]
    differ = sorted(
        {
            k
            for s in settings.values()
            for k in s
            if len({repr(t.get(k)) for t in settings.values()}) > 1
        }
    )
    out = []
    for key, members in keyed.items():
        label = ",".join(f"{k}={settings[key].get(k)}" for k in differ) or members[0].name
        out.append(Group(label, members))
    return out


def _final(run: RunData) -> float | None:
    accs = [r["test_accuracy"] for r in run.rows if r.get("test_accuracy") is not None]
    value = run.summary.get("final_accuracy", accs[-1] if accs else None)
    return float(value) if isinstance(value, int | float) else None


def _best(run: RunData) -> float | None:
    accs = [r["test_accuracy"] for r in run.rows if r.get("test_accuracy") is not None]
    value = run.summary.get("best_accuracy", max(accs) if accs else None)
    return float(value) if isinstance(value, int | float) else None


def _spread(values: list[float | None]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one value), min, max and n of the known values."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(xs),
        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def group_figures(group: Group) -> dict[str, Any]:
    """A group's figures over its seeds (each a :func:`_spread`), for tables and benchmarks."""
    runs = group.runs

    def total(run: RunData, key: str) -> float:
        value = run.summary.get(f"total_{key}", sum(r.get(key, 0) for r in run.rows))
        return float(value)

    return {
        "label": group.label,
        "runs": [run.name for run in runs],
        "seeds": [run.summary.get("config", {}).get("seed") for run in runs],
        "final_accuracy": _spread([_final(r) for r in runs]),
        "best_accuracy": _spread([_best(r) for r in runs]),
        "rounds_run": _spread([float(r.summary.get("rounds_run", len(r.rows))) for r in runs]),
        "mb_up": _spread([total(r, "bytes_up") / MB for r in runs]),
        "mb_down": _spread([total(r, "bytes_down") / MB for r in runs]),
        "wall_s": _spread(
            [float(r.summary["wall_s"]) if "wall_s" in r.summary else None for r in runs]
        ),
    }


def _pm(spread: dict[str, Any], spec: str) -> str:
    if spread["mean"] is None:
        return "-"
    if spread["n"] < 2:
        return format(spread["mean"], spec)
    return f"{spread['mean']:{spec}} ± {spread['sd']:{spec}}"


_GROUP_HEADERS = ["setting", "seeds", "final acc", "best acc", "rounds", "MB up", "MB down"]
_GROUP_HEADERS += ["wall s"]


def group_table(groups: list[Group]) -> str:
    """One line per group: mean ± sample standard deviation over its seeds."""
    table = [_GROUP_HEADERS]
    for group in groups:
        f = group_figures(group)
        table.append(
            [
                group.label,
                str(len(group.runs)),
                _pm(f["final_accuracy"], ".4f"),
                _pm(f["best_accuracy"], ".4f"),
                _pm(f["rounds_run"], ".1f"),
                _pm(f["mb_up"], ".2f"),
                _pm(f["mb_down"], ".2f"),
                _pm(f["wall_s"], ".1f"),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(_GROUP_HEADERS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def _series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list, list]:
    """(rounds, values) for the rows that have ``key``; older runs may lack optional keys."""
    xs, ys = [], []
    for i, row in enumerate(rows, start=1):
        if row.get(key) is not None:
            xs.append(row.get("round", i))
            ys.append(row[key] / scale)
    return xs, ys


def _natural_key(device: str) -> list[Any]:
    # "dev-2" before "dev-10", as a reader expects.
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", device)]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every figure alive until closed
    return path


def session_spans(rows: list[dict[str, Any]]) -> list[tuple[Any, list[dict[str, Any]]]]:
    """Consecutive stretches of rows with the same ``session`` value, in order, as
    (session, rows). A run without sessions (no ``session`` key, or one value throughout)
    gives a single stretch; no rows give none."""
    spans: list[tuple[Any, list[dict[str, Any]]]] = []
    for row in rows:
        session = row.get("session")
        if spans and spans[-1][0] == session:
            spans[-1][1].append(row)
        else:
            spans.append((session, [row]))
    return spans


def _rounds(rows: list[dict[str, Any]]) -> list[int]:
    # Rows without a round number count from 1 by position, as in _series.
    return [int(row.get("round", i)) for i, row in enumerate(rows, start=1)]


def session_starts(rows: list[dict[str, Any]]) -> list[int]:
    """Rounds at which a new session begins: each row whose ``session`` differs from the row
    before it (the first row starts nothing: no session ends there). Empty for a run without
    sessions."""
    return [
        rnd
        for prev, row, rnd in zip(rows, rows[1:], _rounds(rows)[1:], strict=False)
        if row.get("session") != prev.get("session")
    ]


def aux_rounds(rows: list[dict[str, Any]]) -> list[int]:
    """Rounds spent on warm start's auxiliary rounds (``phase == "aux"``)."""
    return [rnd for row, rnd in zip(rows, _rounds(rows), strict=True) if row.get("phase") == "aux"]


def _mark_sessions(ax: Axes, runs: list[RunData], colors: list[str]) -> None:
    """Dashed grey lines where sessions change (once per round, however many runs change
    there) and each run's auxiliary rounds shaded in its colour."""
    starts = sorted({s for run in runs for s in session_starts(run.rows)})
    for k, start in enumerate(starts):
        # Halfway between rounds: the change happens between two rounds, not at one.
        label = "session start" if k == 0 else "_nolegend_"
        ax.axvline(start - 0.5, color="0.4", ls=(0, (5, 3)), lw=0.9, label=label)
    for run, color in zip(runs, colors, strict=True):
        for k, rnd in enumerate(aux_rounds(run.rows)):
            label = f"{run.name}: aux rounds" if k == 0 else "_nolegend_"
            ax.axvspan(rnd - 0.5, rnd + 0.5, color=color, alpha=0.15, lw=0, label=label)


def _plot_accuracy(runs: list[RunData], path: Path) -> Path:
    """Test accuracy per round; with sessions, also the accuracy on the session's classes
    (a second panel, when any run records ``session_accuracy``), session starts and
    auxiliary rounds."""
    with_session_acc = any(r.get("session_accuracy") is not None for run in runs for r in run.rows)
    if with_session_acc:
        fig, (ax, ax_s) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
        axes = [ax, ax_s]
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        axes = [ax]
    colors = []
    for run in runs:
        (line,) = ax.plot(*_series(run.rows, "test_accuracy"), marker=".", label=run.name)
        color = line.get_color()
        colors.append(color)
        stop_round, reason = run.summary.get("stop_round"), run.summary.get("stop_reason")
        # Running out of budget is the normal end; only early stops deserve a marker.
        if stop_round is not None and reason != "budget":
            ax.axvline(stop_round, color=color, ls="--", lw=1, label=f"{run.name}: {reason}")
        if with_session_acc:
            xs, ys = _series(run.rows, "session_accuracy")
            ax_s.plot(xs, ys, marker=".", color=color, label=run.name)
    for axis in axes:
        _mark_sessions(axis, runs, colors)
        axis.grid(alpha=0.3)
    ax.set(ylabel="test accuracy", title="Test accuracy per round")
    if with_session_acc:
        ax_s.set(ylabel="accuracy on the session's classes")
    axes[-1].set_xlabel("round")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    if runs:
        # Below the plot, not on it (inside, "best" covered session 1's curve once the session
        # marks joined) nor beside it (a run's long name took half the figure's width there).
        handles, labels = ax.get_legend_handles_labels()
        axes[-1].legend(
            handles,
            labels,
            fontsize="small",
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12 if with_session_acc else -0.14),
            ncol=2,
            frameon=False,
        )
    return _save(fig, path)


def _plot_per_round(
    runs: list[RunData],
    path: Path,
    title: str,
    panels: list[tuple[str, str, float]],
    off: str = "",
) -> Path:
    """One subplot per (key, y label, scale) in ``panels``, every run overlaid; ``off``, when
    given, is written across a panel whose every value is 0 or missing."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels) + 1), sharex=True)
    axes_list: list[Axes] = list(axes) if len(panels) > 1 else [axes]
    for ax, (key, ylabel, scale) in zip(axes_list, panels, strict=True):
        for run in runs:
            ax.plot(*_series(run.rows, key, scale), marker=".", label=run.name)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # counts and amounts: a flat 0 sits on the axis, not mid-plot
        ax.grid(alpha=0.3)
        if off and all(not any(_series(run.rows, key)[1]) for run in runs):
            ax.text(0.5, 0.5, off, ha="center", va="center", transform=ax.transAxes)
    axes_list[0].set_title(title)
    axes_list[-1].set_xlabel("round")
    axes_list[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if runs:
        axes_list[0].legend(fontsize="small")
    return _save(fig, path)


def _plot_participation(runs: list[RunData], path: Path) -> Path:
    counts = [Counter(d for row in run.rows for d in row.get("participants", [])) for run in runs]
    devices = sorted(set().union(*counts), key=_natural_key)
    fig, ax = plt.subplots(figsize=(min(max(8, 0.3 * len(devices) * max(len(runs), 1)), 30), 5))
    # Grouped bars: each device gets a slot, each run one bar inside it.
    width = 0.8 / max(len(runs), 1)
    for k, (run, count) in enumerate(zip(runs, counts, strict=True)):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(devices))]
        ax.bar(xs, [count[d] for d in devices], width=width, label=run.name)
    ax.set_xticks(range(len(devices)), devices, rotation=90, fontsize="small")
    ax.set(xlabel="device", ylabel="rounds participated", title="Participation per device")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    if not devices:
        ax.text(0.5, 0.5, "no participants recorded", ha="center", transform=ax.transAxes)
    elif runs:
        ax.legend(fontsize="small")
    return _save(fig, path)


def _energy_off(runs: list[RunData]) -> str:
    """What the energy plot says when no run spent any energy."""
    modes = {run.summary.get("config", {}).get("selection.mode") for run in runs}
    if "energy-age" not in modes:
        return "energy off (selection.mode is not energy-age): no energy spent"
    return "no energy spent"


def draw_plots(runs: list[RunData], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    comm = [("bytes_up", "MB up", MB), ("bytes_down", "MB down", MB)]
    energy = [("energy_spent", "energy", 1.0)]
    return [
        _plot_accuracy(runs, out / "accuracy.png"),
        _plot_per_round(runs, out / "communication.png", "Communication per round", comm),
        _plot_per_round(
            runs,
            out / "energy.png",
            "Energy spent per round",
            energy,
            off=_energy_off(runs),
        ),  # fmt: skip
        _plot_participation(runs, out / "participation.png"),
    ]


def _plot_group_accuracy(groups: list[Group], path: Path) -> Path:
    """Each group's mean test accuracy per round, its seeds' range shaded."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for group in groups:
        by_round: dict[int, list[float]] = {}
        for run in group.runs:
            for rnd, acc in zip(*_series(run.rows, "test_accuracy"), strict=True):
                by_round.setdefault(int(rnd), []).append(acc)
        xs = sorted(by_round)
        if not xs:
            continue
        mean = [statistics.fmean(by_round[x]) for x in xs]
        (line,) = ax.plot(xs, mean, marker=".", label=f"{group.label} ({len(group.runs)} seeds)")
        ax.fill_between(
            xs,
            [min(by_round[x]) for x in xs],
            [max(by_round[x]) for x in xs],
            color=line.get_color(),
            alpha=0.2,
            lw=0,
        )
    ax.set(
        xlabel="round",
        ylabel="test accuracy",
        title="Test accuracy per round (mean, range over seeds)",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize="small")
    return _save(fig, path)


def draw_group_plots(groups: list[Group], out_dir: str | Path) -> list[Path]:
    """``accuracy.png`` by group (mean and range over seeds); the other plots per run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for group in groups for run in group.runs]
    paths = draw_plots(runs, out)
    paths[0] = _plot_group_accuracy(groups, out / "accuracy.png")
    return paths


# ---------------------------------------------------------------- CLI


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefleet report", description="Summarise and plot EdgeFleet run folders."
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) or sweep folder(s)"
    )
    parser.add_argument(
        "--out", help="where to write the PNGs (default: the run folder for one run, else ./report)"
    )
    parser.add_argument(
        "--group",
        action="store_true",
        help="group runs that differ only in the seed: mean and spread per group",
    )
    return parser


def _story_of_one(run: RunData) -> str:
    """One finished run's story (what ``edgefleet run`` prints at the end); the summary
    table for a live run, or one whose ``summary.json`` an older version wrote."""
    if not (run.path / "summary.json").is_file():
        return summary_table([run])
    # lazy: story pulls in flwr and ~60 EdgeFleet modules; the plots need only matplotlib
    from edgefleet.simulation.story import story

    try:
        return story(run.path)
    except (KeyError, TypeError) as err:
        print(f"edgefleet report: warning: no story ({err!r} missing or odd in summary.json)",
              file=sys.stderr)  # fmt: skip
        return summary_table([run])


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``edgefleet report``; ``argv`` is what follows the subcommand."""
    parser = report_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits; callers of main() expect a return code
        return exc.code if isinstance(exc.code, int) else 2
    labels: dict[Path, str] | None = None
    dirs: list[Path] = []
    for d in map(Path, args.run_dirs):
        manifest = d / "sweep.json"
        if manifest.is_file():
            labels = labels or {}
            for entry in json.loads(manifest.read_text())["runs"]:
                if (d / entry["run"]).is_dir():
                    dirs.append(d / entry["run"])
                    labels[(d / entry["run"]).resolve()] = entry["point"]
        else:
            dirs.append(d)
    try:
        runs = [load_run(d) for d in dirs]
    except ReportError as exc:
        print(f"edgefleet report: error: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print("edgefleet report: error: no run folders found", file=sys.stderr)
        return 2
    for run in runs:
        for warning in run.warnings:
            print(f"edgefleet report: warning: {warning}", file=sys.stderr)
    grouped = labels is not None or args.group
    default_out = (
        runs[0].path
        if len(runs) == 1
        else Path(args.run_dirs[0]) / "report"
        if (len(args.run_dirs) == 1 and labels is not None)
        else Path("report")
    )
    out = Path(args.out) if args.out else default_out
    print(_story_of_one(runs[0]) if len(runs) == 1 and not grouped else summary_table(runs))
    print()
    if grouped:
        if labels is not None:
            # Runs outside the sweep folders (given beside them) group by their own name.
            labels.update(
                {r.path.resolve(): r.name for r in runs if r.path.resolve() not in labels}
            )
        groups = group_runs(runs, labels)
        print(group_table(groups))
        print()
        paths = draw_group_plots(groups, out)
    else:
        paths = draw_plots(runs, out)
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
