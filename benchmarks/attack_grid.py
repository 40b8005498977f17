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
- ``declined`` and ``rejected``: replies over the run that were errors (a model-side attack
  on a pruned CA-HFP submodel answers with one: the mod needs the update's shapes to match
  the model sent) and replies screening rejected.

Per fleet and defence, ``clean_cost`` = clean accuracy with the defence minus without.
Targets (``targets``), at 20 % attackers with ``--recommend RULE``, over every fleet run:
every attack's ``accuracy_delta`` >= -0.05, backdoor success < 0.10, ``clean_cost`` >= -0.01
(a defence that gains on clean runs meets it). A target with nothing run to judge it (no
0.2 fraction, the rule not among ``--defences``, no backdoor, no ``--recommend``) is null.
``targets_by_defence`` holds the same verdicts for every defence run, and
``beaten_at_0.2``, per fleet, the attacks that no defence run (``off`` aside) holds within
5 points.
``pruned-liar`` only lies on CA-HFP submodels, so it runs on the ``cahfp`` fleet only.
Runs are kept under ``--out`` and reused (a larger grid costs only its new cells).

ALIE and IPM colluders share their honest updates through a folder board of their run
folder's own (EdgeFleet's ClientApp keys it by output-dir and run-name), so one run's
colluders never read another run's posts.

    nice -n 5 python benchmarks/attack_grid.py      # the issue's grid: days on 2 cores
    nice -n 5 python benchmarks/attack_grid.py --fleets fedavg --fractions 0.2 \\
        --attacks sign-flip,alie,ipm,label-flip --defences off,median,trimmed-mean \\
        --devices 10 --rounds 15 --seeds 0
    python benchmarks/attack_grid.py --smoke --out /tmp/ag     # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _provenance import dumps  # type: ignore[import-not-found]
from _runs import ENGINES, parse_with_smoke, run_once  # type: ignore[import-not-found]

from edgefleet.attacks import KINDS as ATTACKS
from edgefleet.simulation.runner import parse_value
from edgefleet.strategies.robust import ROBUST_RULES

ROOT = Path(__file__).resolve().parents[1]
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
    p.add_argument("--recommend", default="", help="the defence the targets judge")
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
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="run-config key, all runs"
    )
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
    if args.recommend and args.recommend not in ROBUST_RULES:
        p.error(f"--recommend {args.recommend!r}; valid choices: {', '.join(ROBUST_RULES)}")
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected KEY=VALUE")
        extra[key.strip()] = parse_value(value.strip())

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    counts = {"new": 0, "reused": 0}
    run_walls: list[float] = []
    backdoor = Backdoor(args) if "backdoor" in attacks else None
    if args.engine == "inprocess":
        # The ServerApp imports it to refuse attack.* keys on the Deployment Engine
        # (edgefleet/server/app.py, refuse_attacks_outside_simulation): seconds in every
        # forked run unless the parent holds it (benchmarks/_runs.py's _preload does not).
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

    by_defence = {d: judge(result, d) for d in defences}
    target = by_defence.get(args.recommend) if args.recommend else None
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
                "recommend": args.recommend or None,
                "target": (
                    f"at {TARGET_FRACTION:g} attackers with the recommended defence: every "
                    f"attack's accuracy_delta >= -{MAX_DROP}, backdoor success < {MAX_BACKDOOR}, "
                    f"clean_cost >= -{MAX_CLEAN_COST}"
                ),
                "targets": target,
                "targets_by_defence": by_defence,
                f"beaten_at_{at}": beaten_by_every_defence(result),
                "skipped": skipped,
                "runs": counts,
                "run_wall_s_mean": round(statistics.fmean(run_walls), 1) if run_walls else None,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


def judge(result: dict[str, Any], defence: str) -> dict[str, bool | None]:
    """The three targets for ``defence`` over every fleet run, at the target fraction; None
    where nothing was run to judge one by."""
    at = f"{TARGET_FRACTION:g}"
    deltas, backdoors, costs = [], [], []
    for per in result.values():
        if defence not in per:
            continue
        entry = per[defence]
        if defence != "off":  # no defence costs nothing by definition
            costs.append(entry["clean_cost"])
        for attack, cells in entry["attacks"].items():
            if at in cells:
                deltas.append(cells[at]["accuracy_delta"])
                if attack == "backdoor":
                    backdoors.append(cells[at]["attack_success_rate"])

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


def beaten_by_every_defence(result: dict[str, Any]) -> dict[str, list[str]]:
    """Per fleet, the attacks that at the target fraction cost more than the target's points
    under every defence run there (``off`` aside); a fleet without a defence run is left out."""
    at = f"{TARGET_FRACTION:g}"
    out = {}
    for fleet, per in result.items():
        rules = [d for d in per if d != "off"]
        if not rules:
            continue
        run = {a for d in rules for a, cells in per[d]["attacks"].items() if at in cells}
        out[fleet] = sorted(
            a
            for a in run
            if all(
                (c := per[d]["attacks"].get(a, {}).get(at)) is not None
                and c["accuracy_delta"] < -MAX_DROP
                for d in rules
            )
        )
    return out


if __name__ == "__main__":
    main()
