"""What a finished run did, in words and one table: the closing output of ``edgefleet run``.

A run with sessions leads with the per-session table (who trained, what each session started
from, rounds until the target accuracy on the session's own classes, energy, bytes), then one
line per technique that was on, saying what it did in this run, then whether it helped against a
reference the run itself has (a warm-started session against the first session, which
started from scratch; the rounds data-free stopping saved, or that it never fired; the
declines energy-aware selection met); the whole-test-set accuracy comes last, labelled for
what it is. Everything is read from ``summary.json`` and
``metrics.jsonl``; nothing here changes them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from edgefleet.loop.context import PruningRow, SelectionRow, SessionRow, StoppingRow
from edgefleet.loop.roundloop import device_order
from edgefleet.server.results import MetricsRow as Row
from edgefleet.server.results import read_metrics


def load(run_dir: Path) -> tuple[dict[str, Any], list[Row]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, read_metrics(run_dir / "metrics.jsonl")


def story(run_dir: Path) -> str:
    summary, rows = load(run_dir)
    cfg = summary["config"]
    out = [
        f"EdgeFleet run {summary['run_name']}: {summary['rounds_run']} rounds "
        f"({summary['stop_reason']}), {summary['wall_s']:.0f} s"
    ]
    if summary.get("sessions"):
        out += ["", *session_table(summary, rows)]
    techniques = [
        line
        for line in (
            _warm_start(cfg, rows),
            _energy(cfg, rows),
            _pruning(cfg, rows),
            _stopping(cfg, rows, summary),
            _async(cfg, rows),
        )
        if line
    ]
    if techniques:
        out += ["", "What each technique did in this run:", *(f"- {t}" for t in techniques)]
    verdicts = [
        line
        for line in (
            _warm_start_helped(cfg, rows, summary),
            _stopping_helped(cfg, rows, summary),
            _energy_helped(cfg, rows),
        )
        if line
    ]
    if verdicts:
        out += ["", "Did it help? (against a reference in this run)", *(f"- {v}" for v in verdicts)]
    out += ["", _whole_test(summary, rows)]
    return "\n".join(out)


def _devices(rows: list[Row]) -> str:
    ids = sorted({d for r in rows for d in r.participants}, key=device_order)
    return " ".join(ids) if ids else "-"


def _start(session: int, mine: list[Row], cfg: dict[str, Any]) -> str:
    """What the session's training started from."""
    mode, pilots = cfg.get("warmstart.mode", "previous"), cfg.get("warmstart.pilot-sessions", 1)
    if session == 1:
        return "the initial model"
    if mode == "fresh":
        return "the initial model (fresh)"
    if mode == "average":
        return "the stored sessions' average"
    if mode != "pilot" or session <= pilots:
        return "the last session's model"
    weights = next((w for r in mine if (w := r.of(SessionRow).warmstart_weights) is not None), None)
    if not weights or not isinstance(weights, dict):
        return "the last session's (no stored look-alike yet)"
    top = max(weights, key=lambda k: weights[k])
    return f"warm: {weights[top]:.2f} on session {top} (of {len(weights)} stored)"


def session_table(summary: dict[str, Any], rows: list[Row]) -> list[str]:
    cfg, target = summary["config"], summary["target_accuracy"]
    head = (
        f"Sessions: who trained, what each started from, rounds until {target:.0%} on the "
        "session's own classes (auxiliary rounds counted)"
    )
    table = [("session", "rounds", "devices trained", "started from", "to target",
              "last acc", "energy", "MB")]  # fmt: skip
    for s in summary["sessions"]:
        mine = [r for r in rows if r.session == s["session"]]
        last = s["final_session_accuracy"]
        table.append(
            (
                str(s["session"]),
                f"{s['start_round']}-{s['start_round'] + s['rounds'] - 1}",
                _devices(mine),
                _start(s["session"], mine, cfg),
                "-" if s["rounds_to_target"] is None else str(s["rounds_to_target"]),
                "-" if last is None else f"{last:.2f}",
                f"{s['energy_spent']:g}",
                f"{s['bytes'] / 1e6:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [head]
    for row in table:
        cells = [
            c.ljust(w) if i in (2, 3) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _warm_start(cfg: dict[str, Any], rows: list[Row]) -> str | None:
    mode = cfg.get("warmstart.mode", "previous")
    if mode == "previous" and cfg.get("sessions.schedule", "none") == "none":
        return None
    weighed = [(r, w) for r in rows if (w := r.of(SessionRow).warmstart_weights)]
    if mode != "pilot" or not weighed:
        return f"Sessions: {len({r.session for r in rows if r.session})}, each " \
            f"started from {'the last session' if mode == 'previous' else mode}."  # fmt: skip
    parts = []
    for r, w in weighed:
        if not isinstance(w, dict):  # an older row's list form names no sessions
            continue
        top = max(w, key=lambda k: w[k])
        parts.append(f"session {r.session} put {w[top]:.2f} on session {top} (of {len(w)})")
    aux = sum(r.of(SessionRow).phase == "aux" for r in rows)
    return (
        f"Warm start (pilot, {cfg['warmstart.pilot-sessions']} pilot sessions): "
        f"{aux} auxiliary round(s) measured each new session's pseudo-gradient; "
        + "; ".join(parts) + "."
    )  # fmt: skip


def _energy(cfg: dict[str, Any], rows: list[Row]) -> str | None:
    if cfg.get("selection.mode") != "energy-age":
        return None
    m = cfg["selection.max-devices"]
    trained = [r for r in rows if r.participants]
    mean = sum(len(r.participants) for r in rows) / max(1, len(rows))
    short = sum(0 < len(r.of(SelectionRow).selected or r.participants) < m for r in rows)
    empty = sum(not r.participants and not r.of(StoppingRow).stopping_resting for r in rows)
    declined = sum(len(r.declined) for r in rows)
    unreachable = sum(len(r.unreachable) for r in rows)
    aggregator = "SAGA server memory (EH-FedSAG)" if cfg["strategy"] == "fedsag" else \
        "the participants' plain mean (EH-FedAvg)"  # fmt: skip
    return (
        f"Energy: at most {m} devices a round, oldest affordable first, {aggregator}: "
        f"{mean:.1f} trained a round on average ({len(trained)} rounds trained), {short} rounds "
        f"had fewer than {m} affordable, {empty} none; {declined} declines; "
        f"{unreachable} train messages to unreachable devices; "
        f"{sum(r.energy_spent for r in rows):g} energy units spent."
    )


def _pruning(cfg: dict[str, Any], rows: list[Row]) -> str | None:
    ratios = cfg.get("pruning.keep-ratios") or ""
    if not ratios and cfg.get("pruning.keep-ratio", 1.0) >= 1.0:
        return None
    compact = sum(r.of(PruningRow).compact_replies or 0 for r in rows)
    replies = sum(len(r.participants) for r in rows)
    kept = [
        k for r in rows if r.participants and (k := r.of(PruningRow).mean_kept_fraction) is not None
    ]
    share = f"{sum(kept) / len(kept):.2f}" if kept else "-"
    return (
        f"CA-HFP (keep ratios {ratios or cfg['pruning.keep-ratio']}): {compact} of {replies} "
        f"replies were curvature-pruned submodels, rebuilt by the server; the participants "
        f"kept {share} of the parameters on average."
    )


def _stopping(cfg: dict[str, Any], rows: list[Row], summary: dict[str, Any]) -> str | None:
    mode = cfg.get("stopping.mode", "off")
    if mode != "data-free":
        return None
    rested = [r for r in rows if r.of(StoppingRow).stopping_resting]
    if rested:
        sessions = sorted({r.session for r in rested})
        return (
            f"Data-free stopping: the task vector stopped growing in sessions "
            f"{', '.join(map(str, sessions))}; their devices rested for {len(rested)} rounds "
            "(no training, no energy) until the next session."
        )
    if summary["stop_reason"] == "task-vector-plateau":
        saved = cfg["num-server-rounds"] - summary["rounds_run"]
        return (
            f"Data-free stopping: stopped at round {summary['stop_round']} ({saved} rounds saved)."
        )
    return (
        f"Data-free stopping: measured the task vector's growth every round; it never stayed "
        f"below tau ({cfg.get('stopping.tau', '?')}) for {cfg.get('stopping.patience', '?')} "
        "rounds in a row."
    )


def _async(cfg: dict[str, Any], rows: list[Row]) -> str | None:
    """Asynchronous aggregation: how stale the updates were and what was dropped."""
    if cfg.get("aggregation.mode") != "async" or not rows:
        return None
    # The loop's asynchronous columns are no component's section: they read as extras.
    stale = [
        r.extra["staleness_median"] for r in rows if r.extra.get("staleness_median") is not None
    ]
    worst = max((r.extra.get("staleness_max") or 0 for r in rows), default=0)
    dropped = sum(r.extra.get("dropped") or 0 for r in rows)
    median = f"{statistics.median(stale):g}" if stale else "-"
    return (
        f"Asynchronous aggregation (FedBuff): {len(rows)} versions of "
        f"{cfg.get('async.buffer-size')} updates, {cfg.get('async.concurrency')} devices "
        f"training at once; update staleness median {median} versions (at most {worst}), "
        f"{dropped} replies dropped."
    )


def _session_curve(rows: list[Row], session: int) -> list[float | None]:
    """A session's accuracy on its own classes, round by round from its start, as
    ``rounds_to_target`` counts it: an auxiliary row only when it evaluated the warm start."""
    parts = [r.of(SessionRow) for r in rows if r.session == session]
    return [p.session_accuracy if p.phase != "aux" or p.warm_start else None for p in parts]


def _warm_start_helped(cfg: dict[str, Any], rows: list[Row], summary: dict[str, Any]) -> str | None:
    """Each later session against session 1 (from the initial model): the rounds it took to
    reach session 1's final accuracy, else the accuracy both had after the same rounds."""
    sessions = summary.get("sessions") or []
    if len(sessions) < 2 or cfg.get("warmstart.mode", "previous") == "fresh":
        return None
    ref = _session_curve(rows, sessions[0]["session"])
    ref_final = next((a for a in reversed(ref) if a is not None), None)
    if ref_final is None:
        return None
    parts = []
    for s in sessions[1:]:
        mine = _session_curve(rows, s["session"])
        reached = next(
            (i + 1 for i, a in enumerate(mine) if a is not None and a >= ref_final), None
        )
        if reached is not None:
            diff = len(ref) - reached
            verdict = "helped" if diff > 0 else "no gain" if diff == 0 else "slower"
            than = "as many" if diff == 0 else f"{abs(diff)} {'fewer' if diff > 0 else 'more'}"
            parts.append(
                f"session {s['session']} reached it in {reached} round(s) ({than}: {verdict})"
            )
            continue
        n = min(len(ref), len(mine))
        at = [
            (a, b)
            for a, b in zip(ref[:n], mine[:n], strict=True)
            if a is not None and b is not None
        ]
        if not at:
            parts.append(f"session {s['session']} has no accuracy to compare")
            continue
        a, b = at[-1]
        verdict = "helped" if b > a else "did not help"
        parts.append(
            f"session {s['session']} did not reach it in {len(mine)} round(s); after "
            f"{len(at)} round(s) it had {b:.2f} against session 1's {a:.2f} ({verdict})"
        )
    return (
        f"Warm start vs session 1 from scratch ({ref_final:.2f} on its classes after "
        f"{len(ref)} round(s)): " + "; ".join(parts) + "."
    )


def _stopping_helped(cfg: dict[str, Any], rows: list[Row], summary: dict[str, Any]) -> str | None:
    if cfg.get("stopping.mode", "off") != "data-free":
        return None
    rested = sum(bool(r.of(StoppingRow).stopping_resting) for r in rows)
    budget = cfg.get("num-server-rounds", len(rows))
    saved = budget - summary["rounds_run"] if summary["stop_reason"] == "task-vector-plateau" else 0
    if rested or saved:
        what = [f"{saved} of {budget} rounds not run"] if saved else []
        what += [f"{rested} round(s) in which the devices rested"] if rested else []
        return f"Data-free stopping saved {' and '.join(what)} (no training, no energy)."
    return (
        f"Data-free stopping never fired: the task vector grew faster than tau "
        f"({cfg.get('stopping.tau', '?')}) often enough that all {len(rows)} rounds ran; "
        "it saved nothing in this run."
    )


def _energy_helped(cfg: dict[str, Any], rows: list[Row]) -> str | None:
    if cfg.get("selection.mode") != "energy-age":
        return None
    declined = sum(len(r.declined) for r in rows)
    unreachable = sum(len(r.unreachable) for r in rows)
    sent = sum(
        len(r.participants) + len(r.declined) + len(r.rejected) + len(r.unreachable) for r in rows
    )
    if not sent:
        return "Energy-aware selection sent no train message in this run."
    return (
        f"Energy-aware selection: {declined} of {sent} train messages were declined (a "
        "battery short of the round's cost, or another error of the device's; the battery is "
        f"asked before a device is sent one), {unreachable} went to devices the transport "
        "could not reach. The declines a battery-blind selection would have met are not "
        "measured in this run."
    )


def _whole_test(summary: dict[str, Any], rows: list[Row]) -> str:
    final, best = summary["final_accuracy"], summary["best_accuracy"]
    text = "-" if final is None else f"final {final:.3f}, best {best:.3f}"
    if summary.get("sessions") and summary["config"].get("sessions.schedule") == "alternate":
        return (
            f"Whole-test-set accuracy (all classes; each session's devices hold only their "
            f"group's classes, so this stays low by design): {text}."
        )
    return f"Test-set accuracy: {text}."
