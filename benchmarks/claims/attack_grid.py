"""Attacks x defences x attacker fraction on a non-IID fleet (issue 25 item 3).

Every cell is one seeded run of EdgeFleet's real ServerApp and ClientApp (``--engine
inprocess`` by default: the same apps in a child process, no Ray; ``simulation``: Flower's
Simulation Engine) with ``attack.kind`` = the attack, ``attack.fraction`` = the fraction
(``round(fraction x devices)`` partitions attack, at least one, drawn with ``seed``) and
``robust.rule`` = the defence, on one of three fleets (``--fleets``):

- ``fedavg``: FedAvg over every device;
- ``fedsag-energy``: FedSAG under energy-age selection (batteries harvesting with
  ``--harvest-prob``, at most ``--max-devices`` trained a round; the rule replaces FedSAG's
  memory and correction means; ``--saga-max-age`` sets ``saga.max-age``);
- ``cahfp``: FedAvg over CA-HFP submodels, keep ratios 1.0/0.5 alternating over the
  partitions (the rule works per coordinate over the devices that kept it).

For each fleet and defence a clean run (``attack.kind = "off"``) is the reference, and the
clean run without a defence (``robust.rule = "off"``) is always run. The JSON line has, per
fleet, defence, attack and fraction (means over ``--seeds``, each seed's figures beside):

- ``accuracy_delta``: final accuracy minus the clean run's with the same defence and fleet;
- ``attack_success_rate`` (backdoor only): the share of triggered test images (every test
  image not of ``attack.target``, with the training trigger: a 3 x 3 square of the largest
  training pixel, bottom right) that the final model classes as the target, next to the
  same share for the clean run's model (``clean_attack_success_rate``). The final model is
  the run folder's ``checkpoint.npz`` (written after every round, kept when the run ends:
  the model the summary's ``final_accuracy`` is of);
- ``declined`` and ``rejected``: replies over the run that were errors and replies
  screening rejected. A ``stale-poison`` device declines every train message after its one
  upload (``ERR_ABSENT``); a model-side attack that cannot rewrite a reply answers with an
  error naming why (a reply whose arrays match neither the model sent nor, for a CA-HFP
  device that pruned that model itself, the plan's cut of it). Such a pruned device is
  attacked on the channels it kept: the mod cuts the same channels from the sent model with
  the model's pruning plan (``attack_mod(..., plan=...)``; EdgeFleet's ClientApp passes its
  own) and poisons the update there, and ALIE/IPM colluders of one keep ratio collude among
  themselves (their updates have the same length).

Per fleet and defence, ``clean_cost`` = clean accuracy with the defence minus without.

Verdicts (``verdicts``), per fleet, at 20 % attackers: ``--recommend`` names the defence
each fleet is judged with, one rule for every fleet run (``median``) or per fleet
(``fedavg=median,cahfp=median,fedsag-energy=trimmed-mean``; a fleet left out has no
recommended rule). It must be among ``--defences`` (a defence that is not measured is not
recommended); a bad one stops the benchmark before any run, naming the valid fleets and
rules. Each fleet's entry has ``rule`` (the recommended one, or null) and for it
``targets``: every attack's ``accuracy_delta`` >= -0.05, backdoor success < 0.10,
``clean_cost`` >= -0.01 (a defence that gains on clean runs meets it); ``met`` (all three
true: true; one false: false; else null); ``worst_attack`` (the attack with the lowest
``accuracy_delta`` and that delta). A target with nothing measured to judge it (no 0.2
fraction, no backdoor, no rule recommended for the fleet, ``off``'s clean cost, zero by
definition) is null, never true. ``targets_by_defence`` holds the same verdicts for every
defence run on the fleet, and ``beaten_at_0.2`` the attacks that beat every rule offered
(``off`` aside), each rule's figures beside: an attack beats a rule when its
``accuracy_delta`` is below -0.05 or, for the backdoor, its success is 0.10 or more; null
where no rule was run at 0.2.
``pruned-liar`` only lies on CA-HFP submodels, so it runs on the ``cahfp`` fleet only.
Runs are kept under ``--out`` and reused (a larger grid costs only its new cells).

ALIE and IPM colluders share their honest updates through a folder board of their run
folder's own (EdgeFleet's ClientApp keys it by output-dir and run-name), so one run's
colluders never read another run's posts.

    nice -n 5 python -m benchmarks.claims.attack_grid      # the issue's grid: days on 2 cores
    nice -n 5 python -m benchmarks.claims.attack_grid --fleets fedavg --fractions 0.2 \\
        --attacks sign-flip,alie,ipm,label-flip --defences off,median,trimmed-mean \\
        --devices 10 --rounds 15 --seeds 0
    python -m benchmarks.claims.attack_grid --smoke --out /tmp/ag     # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.overrides import add_set_arg, parse_sets
from benchmarks.lib.provenance import dumps
from benchmarks.lib.runs import ENGINES, parse_with_smoke, run_once
from edgefleet.attacks import KINDS as ATTACKS
from edgefleet.strategies.robust import ROBUST_RULES

ROOT = Path(__file__).resolve().parents[2]
FLEETS = ("fedavg", "fedsag-energy", "cahfp")
TARGET_FRACTION = 0.2
MAX_DROP = 0.05  # accuracy points (as a fraction) an attack may cost under the defence
MAX_BACKDOOR = 0.10
MAX_CLEAN_COST = 0.01
PATTERN_SIZE = 3  # edgefleet.attacks.data's default trigger, as the ClientApp plants it
# --smoke: the whole path (clean references, an attack, the backdoor's success rate, the
# defence's clean cost, the targets) at the smallest sizes.
SMOKE: dict[str, Any] = {
    "devices": 3,
    "rounds": 2,
    "local_steps": 1,
    "eval_samples": 200,
    "attacks": "backdoor",
    "defences": "off,median",
    "fractions": "0.2",
    "fleets": "fedavg",
    "seeds": "0",
    "recommend": "median",
}


def fleet_config(fleet: str, args: argparse.Namespace) -> dict[str, Any]:
    if fleet == "fedavg":
        return {"strategy": "fedavg"}
    if fleet == "fedsag-energy":
        return {
            "strategy": "fedsag",
            "selection.mode": "energy-age",
            "selection.max-devices": args.max_devices or max(2, args.devices // 4),
            "energy.capacity": 8.0,
            "energy.train-slots": 3,
            "energy.harvest-prob": args.harvest_prob,
            "saga.max-age": args.saga_max_age,
        }
    if fleet == "cahfp":
        return {
            "strategy": "fedavg",
            "pruning.keep-ratios": "1.0,0.5",
            "pruning.criterion": "curvature",
            "pruning.reconstruction": "global",
        }
    raise ValueError(f"unknown fleet {fleet!r}; valid choices: {', '.join(FLEETS)}")


def attack_config(attack: str, fraction: float, devices: int) -> dict[str, Any]:
    if attack == "off":
        return {}
    out: dict[str, Any] = {"attack.kind": attack, "attack.fraction": fraction}
    if attack == "sybil":
        # Two claimed ids per attacker: within a round the attackers claim different ones.
        count = min(devices, max(1, round(fraction * devices)))
        out["attack.sybil-ids"] = ",".join(str(1000 + i) for i in range(2 * count))
    return out


class Backdoor:
    """The backdoor's success on the central test set, for a run folder's final model."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from edgefleet.task.datasets import load_dataset

        torch.set_num_threads(1)  # as the runs' devices; the machine is shared

        data_dir = str(Path(args.data_dir).resolve()) if args.data_dir else ""
        train, self.test, self.info = load_dataset(args.dataset, data_dir)
        # poison() triggers with the largest pixel of the attacker's training set; every
        # partition of MNIST holds a white pixel, the training pool's largest.
        self.value = float(train.x.max())
        self.model_name, self.target = args.model, args.backdoor_target

    def success(self, run_dir: Path, rounds_run: int) -> float:
        """The rate for ``run_dir``'s final model, kept in ``run_dir/attack_success.json``
        so that a reused run is not evaluated again."""
        cache = run_dir / "attack_success.json"
        key = {"target": self.target, "pattern_size": PATTERN_SIZE, "value": self.value}
        if cache.exists():
            stored = json.loads(cache.read_text())
            if stored["trigger"] == key:
                return float(stored["attack_success_rate"])
        rate = self._measure(run_dir, rounds_run)
        cache.write_text(json.dumps({"trigger": key, "attack_success_rate": rate}) + "\n")
        return rate

    def _measure(self, run_dir: Path, rounds_run: int) -> float:
        import numpy as np
        import torch

        from edgefleet.attacks import attack_success_rate
        from edgefleet.server.checkpoint import load_checkpoint
        from edgefleet.task.models import build_model
        from edgefleet.task.train import set_arrays

        ckpt = load_checkpoint(run_dir / "checkpoint.npz")
        if ckpt.round != rounds_run:
            raise SystemExit(
                f"{run_dir}: its checkpoint is of round {ckpt.round}, the summary's last is "
                f"{rounds_run}: not the final model"
            )
        model = build_model(self.model_name, self.info.input_shape, self.info.num_classes)
        set_arrays(model, ckpt.array_record())
        model.eval()

        def predict(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return np.concatenate(
                    [
                        model(torch.from_numpy(x[i : i + 200])).argmax(1).numpy()
                        for i in range(0, len(x), 200)
                    ]
                )

        return attack_success_rate(
            predict, self.test.x, self.test.y, self.target, PATTERN_SIZE, self.value
        )


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attacks", default=",".join(ATTACKS), help=", ".join(ATTACKS))
    p.add_argument("--defences", default=",".join(ROBUST_RULES), help=", ".join(ROBUST_RULES))
    p.add_argument("--fractions", default="0.1,0.2,0.3", help="attacker fractions")
    p.add_argument("--fleets", default=",".join(FLEETS), help=", ".join(FLEETS))
    p.add_argument("--seeds", default="0")
    p.add_argument(
        "--recommend",
        default="",
        help="the defence each fleet's targets judge: RULE for all, or FLEET=RULE,...",
    )
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--eval-samples", type=int, default=0, help="test images (0: all)")
    p.add_argument("--max-devices", type=int, default=0, help="fedsag-energy M (0: devices/4)")
    p.add_argument("--harvest-prob", type=float, default=0.5, help="fedsag-energy P_h")
    p.add_argument("--saga-max-age", type=int, default=0, help="fedsag-energy saga.max-age")
    p.add_argument("--backdoor-target", type=int, default=0, help="attack.target")
    p.add_argument("--data-dir", default="", help="default: EdgeFleet's data search")
    p.add_argument("--engine", choices=ENGINES, default="inprocess")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per run")
    p.add_argument("--out", default=str(ROOT / "runs" / "attack_grid"))
    add_set_arg(p)
    args = parse_with_smoke(p, SMOKE)

    def names(flag: str, valid: tuple[str, ...]) -> list[str]:
        got = [x.strip() for x in getattr(args, flag).split(",") if x.strip()]
        unknown = [x for x in got if x not in valid]
        if unknown:
            p.error(f"--{flag}: unknown {unknown}; valid choices: {', '.join(valid)}")
        return got

    attacks, defences = names("attacks", ATTACKS), names("defences", ROBUST_RULES)
    fleets = names("fleets", FLEETS)
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    bad = [f for f in fractions if not 0 < f <= 0.5]
    if bad:
        p.error(f"--fractions {bad}: each must be in (0, 0.5]")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        p.error("--seeds: give at least one seed")
    try:
        recommend = parse_recommend(args.recommend, fleets, defences)
    except ValueError as err:
        p.error(str(err))
    extra = parse_sets(p, args.set)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    counts = {"new": 0, "reused": 0}
    run_walls: list[float] = []
    backdoor = Backdoor(args) if "backdoor" in attacks else None
    if args.engine == "inprocess":
        # The ServerApp imports it to refuse attack.* keys on the Deployment Engine
        # (edgefleet/server/app.py, refuse_attacks_outside_simulation): seconds in every
        # forked run unless the parent holds it (benchmarks/lib/runs.py's _preload does not).
        import flwr.superlink.grid  # noqa: F401
    federation = {"num-supernodes": args.devices, "client-resources-num-cpus": 1}

    def run(fleet: str, defence: str, attack: str, fraction: float, seed: int) -> dict[str, Any]:
        tag = "clean" if attack == "off" else f"{attack}-f{fraction:g}"
        name = f"{fleet}-{defence}-{tag}-s{seed}"
        config = {
            "num-server-rounds": args.rounds,
            "dataset": args.dataset,
            "data-dir": str(Path(args.data_dir).resolve()) if args.data_dir else "",
            "partition": "dirichlet",
            "alpha": args.alpha,
            "model": args.model,
            "local-steps": args.local_steps,
            "lr": args.lr,
            "eval-samples": args.eval_samples,
            "min-nodes": args.devices,
            "seed": seed,
            **fleet_config(fleet, args),
            "robust.rule": defence,
            **attack_config(attack, fraction, args.devices),
            **extra,
        }
        fresh = not (out / name / "summary.json").exists()
        rows = run_once(out, name, federation, config, args.timeout, engine=args.engine)
        counts["new" if fresh else "reused"] += 1
        summary = json.loads((out / name / "summary.json").read_text())
        if fresh:
            run_walls.append(float(summary["wall_s"]))
        res: dict[str, Any] = {
            "final_accuracy": summary["final_accuracy"],
            "rounds_run": summary["rounds_run"],
            "declined": sum(len(r.get("declined") or []) for r in rows),
            "rejected": sum(len(r.get("rejected") or []) for r in rows),
        }
        if backdoor is not None and attack in ("off", "backdoor"):
            res["attack_success_rate"] = round(
                backdoor.success(out / name, summary["rounds_run"]), 4
            )
        return res

    result: dict[str, Any] = {}
    skipped: list[str] = []
    for fleet in fleets:
        clean: dict[str, list[dict[str, Any]]] = {
            d: [run(fleet, d, "off", 0.0, s) for s in seeds]
            for d in dict.fromkeys(["off", *defences])
        }
        no_defence = statistics.fmean(r["final_accuracy"] for r in clean["off"])
        per_defence: dict[str, Any] = {}
        for defence in defences:
            ref = clean[defence]
            ref_acc = statistics.fmean(r["final_accuracy"] for r in ref)
            entry: dict[str, Any] = {
                "clean_accuracy": round(ref_acc, 4),
                "clean_cost": round(ref_acc - no_defence, 4),
                "clean_seeds": ref,
                "attacks": {},
            }
            if backdoor is not None:
                entry["clean_attack_success_rate"] = _mean([r["attack_success_rate"] for r in ref])
            for attack in attacks:
                if attack == "pruned-liar" and fleet != "cahfp":
                    skipped.append(f"{fleet}/{defence}/pruned-liar: lies only on CA-HFP submodels")
                    continue
                cells: dict[str, Any] = {}
                for fraction in fractions:
                    per_seed = [run(fleet, defence, attack, fraction, s) for s in seeds]
                    deltas = [
                        r["final_accuracy"] - c["final_accuracy"]
                        for r, c in zip(per_seed, ref, strict=True)
                    ]
                    cell: dict[str, Any] = {
                        "accuracy_delta": _mean(deltas),
                        "final_accuracy": _mean([r["final_accuracy"] for r in per_seed]),
                        "declined": sum(r["declined"] for r in per_seed),
                        "rejected": sum(r["rejected"] for r in per_seed),
                        "seeds": per_seed,
                    }
                    if attack == "backdoor":
                        cell["attack_success_rate"] = _mean(
                            [r["attack_success_rate"] for r in per_seed]
                        )
                    cells[f"{fraction:g}"] = cell
                entry["attacks"][attack] = cells
            per_defence[defence] = entry
        result[fleet] = per_defence

    at = f"{TARGET_FRACTION:g}"
    print(
        dumps(
            {
                "benchmark": "attack_grid",
                "sizes": {
                    k: getattr(args, k)
                    for k in ("devices", "rounds", "local_steps", "lr", "dataset", "alpha")
                    + ("model", "eval_samples", "attacks", "defences", "fractions", "fleets")
                    + ("seeds", "max_devices", "harvest_prob", "saga_max_age", "engine")
                    + ("backdoor_target", "smoke")
                }
                | {"set": extra},
                "fleets": result,
                "recommend": {f: recommend.get(f) for f in fleets},
                "target": (
                    f"per fleet, at {at} attackers with its recommended defence: every "
                    f"attack's accuracy_delta >= -{MAX_DROP}, backdoor success < {MAX_BACKDOOR}, "
                    f"clean_cost >= -{MAX_CLEAN_COST}"
                ),
                "verdicts": verdicts(result, recommend),
                "skipped": skipped,
                "runs": counts,
                "run_wall_s_mean": round(statistics.fmean(run_walls), 1) if run_walls else None,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


def parse_recommend(text: str, fleets: list[str], defences: list[str]) -> dict[str, str]:
    """``--recommend`` as fleet -> rule: ``""`` (none), one rule for every fleet in
    ``fleets`` (``median``), or ``FLEET=RULE`` pairs (a fleet left out has none). A ValueError
    naming the valid fleets and rules for anything else, and for a rule not among
    ``defences`` (a defence that is not measured is not recommended)."""
    text = text.strip()
    if not text:
        return {}
    valid = (
        f"give one rule for every fleet (e.g. median) or FLEET=RULE pairs (e.g. "
        f"fedavg=median,cahfp=median); fleets run: {', '.join(fleets)}; rules run "
        f"(--defences): {', '.join(defences)}"
    )
    items = [x.strip() for x in text.split(",") if x.strip()]
    if len(items) == 1 and "=" not in items[0]:
        chosen = dict.fromkeys(fleets, items[0])
    else:
        chosen = {}
        for item in items:
            fleet, sep, rule = (x.strip() for x in item.partition("="))
            if not sep:
                raise ValueError(f"--recommend {item!r}: expected FLEET=RULE; {valid}")
            if fleet not in FLEETS:
                raise ValueError(
                    f"--recommend {item!r}: unknown fleet {fleet!r} (valid fleets: "
                    f"{', '.join(FLEETS)}); {valid}"
                )
            if fleet not in fleets:
                raise ValueError(f"--recommend {item!r}: fleet {fleet!r} is not run; {valid}")
            if fleet in chosen:
                raise ValueError(f"--recommend: fleet {fleet!r} named twice; {valid}")
            chosen[fleet] = rule
    for fleet, rule in chosen.items():
        if rule not in ROBUST_RULES:
            raise ValueError(
                f"--recommend: unknown rule {rule!r} for {fleet}; valid rules: "
                f"{', '.join(ROBUST_RULES)}; {valid}"
            )
        if rule not in defences:
            raise ValueError(
                f"--recommend: {rule!r} for {fleet} is not among --defences, so it would not "
                f"be measured; {valid}"
            )
    return chosen


def _cells_at(per: dict[str, Any], defence: str) -> dict[str, dict[str, Any]]:
    """Attack -> its cell at the target fraction, for ``defence`` on one fleet."""
    at = f"{TARGET_FRACTION:g}"
    entry = per.get(defence)
    if entry is None:
        return {}
    return {a: cells[at] for a, cells in entry["attacks"].items() if at in cells}


def _holds(attack: str, cell: dict[str, Any]) -> bool:
    """Whether a rule holds ``attack`` at a cell: within the points, the backdoor under the
    success target."""
    if cell["accuracy_delta"] < -MAX_DROP - 1e-9:
        return False
    rate = cell.get("attack_success_rate") if attack == "backdoor" else None
    return rate is None or rate < MAX_BACKDOOR


def judge(per: dict[str, Any], defence: str | None) -> dict[str, bool | None]:
    """The three targets for ``defence`` on one fleet (``per``: defence -> its entry), at the
    target fraction; None where nothing was measured to judge one by (no defence, the
    defence not run, no cell at the fraction, no backdoor, ``off``'s clean cost)."""
    cells = _cells_at(per, defence) if defence is not None else {}
    deltas = [c["accuracy_delta"] for c in cells.values()]
    backdoors = [
        c["attack_success_rate"]
        for a, c in cells.items()
        if a == "backdoor" and c.get("attack_success_rate") is not None
    ]
    costs = []
    if defence is not None and defence != "off" and defence in per:
        costs.append(per[defence]["clean_cost"])  # no defence costs nothing by definition

    def verdict(values: list[float], ok: Any) -> bool | None:
        return all(ok(v) for v in values) if values else None

    return {
        f"attacks_within_{round(100 * MAX_DROP)}_points": verdict(
            deltas, lambda d: d >= -MAX_DROP - 1e-9
        ),
        f"backdoor_success_under_{round(100 * MAX_BACKDOOR)}pct": verdict(
            backdoors, lambda a: a < MAX_BACKDOOR
        ),
        f"clean_cost_within_{round(100 * MAX_CLEAN_COST)}_point": verdict(
            costs, lambda c: c >= -MAX_CLEAN_COST - 1e-9
        ),
    }


def met(targets: dict[str, bool | None]) -> bool | None:
    """All targets true: True; one false: False; else (one unjudged) None."""
    values = list(targets.values())
    if False in values:
        return False
    return True if values and all(v is True for v in values) else None


def worst_attack(per: dict[str, Any], defence: str | None) -> dict[str, Any] | None:
    """The attack with the lowest ``accuracy_delta`` under ``defence`` at the target
    fraction on one fleet, and that delta; None where none was run."""
    cells = _cells_at(per, defence) if defence is not None else {}
    if not cells:
        return None
    attack = min(cells, key=lambda a: (cells[a]["accuracy_delta"], a))
    return {"attack": attack, "accuracy_delta": cells[attack]["accuracy_delta"]}


def beaten_by_every_rule(per: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """On one fleet, the attacks that at the target fraction beat every rule run (``off``
    aside; see :func:`_holds`), each rule's figures beside; None where no rule was run at
    the fraction. An attack a rule was not run against is not counted as beating it."""
    rules = [d for d in per if d != "off"]
    cells = {d: _cells_at(per, d) for d in rules}
    attacks = {a for d in rules for a in cells[d]}
    if not attacks:
        return None
    out = {}
    for attack in sorted(attacks):
        if all(attack in cells[d] and not _holds(attack, cells[d][attack]) for d in rules):
            out[attack] = {
                d: {
                    k: cells[d][attack][k]
                    for k in ("accuracy_delta", "attack_success_rate")
                    if k in cells[d][attack]
                }
                for d in rules
            }
    return out


def verdicts(result: dict[str, Any], recommend: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per fleet of ``result`` (the line's ``fleets``: fleet -> defence -> entry; a saved
    line's ``fleets`` reads the same), the verdicts of the module docstring for the rule
    ``recommend`` names for it (none: null targets)."""
    out = {}
    for fleet, per in result.items():
        rule = recommend.get(fleet)
        targets = judge(per, rule)
        out[fleet] = {
            "rule": rule,
            "targets": targets,
            "met": met(targets),
            "worst_attack": worst_attack(per, rule),
            "targets_by_defence": {d: judge(per, d) for d in per},
            f"beaten_at_{TARGET_FRACTION:g}": beaten_by_every_rule(per),
        }
    return out


if __name__ == "__main__":
    main()
