"""CA-HFP's accuracy claims (arXiv 2603.12591): pruning criteria and reconstruction.

A fleet with a mix of resource classes (keep ratios, default 1.0, 0.75, 0.5, 0.25 over the
devices) trains SmallCNN on Dirichlet non-IID data. Variants, all on Flower's Simulation
Engine with the same seeds:

- ``full``: every device trains the full model (FedAvg, the accuracy ceiling);
- ``curvature``, ``magnitude``, ``random``: each device keeps its share of the model
  (``--budget``: of its parameters by default) by that criterion, the server rebuilds the
  submodels with the global values (CA-HFP); ``curvature`` uses the Taylor score
  ``|g w - h w^2 / 2|``;
- ``curvature-signed``: curvature with the seed's signed score ``g w + h w^2``;
- ``curvature-hutchinson`` (optional): the Taylor score with Hutchinson's estimate of the
  true Hessian diagonal instead of the empirical Fisher;
- ``curvature-seed`` (optional): the seed's score exactly, signed with Hutchinson's Hessian
  diagonal;
- ``no-reconstruction``: curvature pruning, pruned entries filled with zeros (the paper's
  ablation);
- ``elementwise`` (optional, ``--variants``): each entry averaged over the devices that
  kept it;
- ``compact-download`` (optional): curvature, and a pruned device is sent only its slice of
  the model once its channels are known (full model every ``pruning.refresh-rounds``);
- ``heterofl``, ``fedrolex``, ``fjord`` (optional, the field's baselines at the same keep
  ratios): HeteroFL's static prefix slice, FedRolex's rolling slice and FjORD's ordered
  dropout, each entry averaged over the devices that hold it (their papers' aggregation).

Learning rates: ``--lrs`` and ``--variant-lr`` as in ``fedsag_claims`` (every variant gets
the same sweep, each its pick; ``benchmarks/lib/lrsweep.py``), the run names and labels then
carry the lr (``fjord@lr0.03``).

Reported per (alpha, variant): final accuracy (mean over seeds and per seed), the mean
over the last three rounds, bytes up and down per round, and the share of the parameters the
devices kept (mean over rounds of the participants' mean). The paper claims
curvature >= magnitude >= random, near full-model accuracy, and a large drop without
reconstruction (73.1% -> 62.8% on CIFAR-10 at alpha 0.1).

    # full MNIST, as measured for the README (when a keep ratio meant channels)
    python -m benchmarks.claims.pruning_claims --data-dir ../shared/data --budget channels \
        --variants full,curvature,magnitude,random,no-reconstruction
    python -m benchmarks.claims.pruning_claims --dataset cifar10 --model resnet8 --alphas 0.1 \
        --seeds 0,1 --data-dir ../shared/data                            # CIFAR-10 (JPEG copy)
    python -m benchmarks.claims.pruning_claims --smoke --out /tmp/pc                # seconds

``--engine inprocess`` runs the same ServerApp and ClientApp without Ray (``lib/runs.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.lrsweep import LAST, LR_RULE, add_lr_args, choose_lrs, lr_arms
from benchmarks.lib.provenance import dumps, machine
from benchmarks.lib.runs import ENGINES, parse_with_smoke, run_cells, run_once
from edgefleet.pruning.names import BUDGETS
from edgefleet.simulation.report import draw_plots, load_run

ROOT = Path(__file__).resolve().parents[2]

VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"pruning.keep-ratios": "1.0"},
    "curvature": {"pruning.criterion": "curvature"},
    "curvature-signed": {"pruning.criterion": "curvature", "pruning.score": "signed"},
    "curvature-hutchinson": {"pruning.criterion": "curvature", "pruning.hessian": "hutchinson"},
    # The score exactly as the seed writes it: signed, with Hutchinson's Hessian diagonal.
    "curvature-seed": {
        "pruning.criterion": "curvature",
        "pruning.score": "signed",
        "pruning.hessian": "hutchinson",
    },
    "magnitude": {"pruning.criterion": "magnitude"},
    "random": {"pruning.criterion": "random"},
    "no-reconstruction": {"pruning.criterion": "curvature", "pruning.reconstruction": "zeros"},
    "elementwise": {"pruning.criterion": "curvature", "pruning.reconstruction": "elementwise"},
    "compact-download": {"pruning.criterion": "curvature", "pruning.compact-download": True},
    # The field's width-slice baselines at the same keep ratios, each with its own paper's
    # aggregation (every entry averaged over the devices that hold it).
    "heterofl": {"pruning.criterion": "prefix", "pruning.reconstruction": "elementwise"},
    "fedrolex": {"pruning.criterion": "rolling", "pruning.reconstruction": "elementwise"},
    "fjord": {"pruning.criterion": "ordered-dropout", "pruning.reconstruction": "elementwise"},
}
# --smoke: the full model (the *_vs_full ratios) beside a pruned, scored and rebuilt one.
SMOKE: dict[str, Any] = {
    "dataset": "mnist-5k",
    "alphas": "1.0",
    "variants": "full,curvature",
    "seeds": "0",
    "devices": 2,
    "keep_ratios": "1.0,0.5",
    "rounds": 2,
    "local_steps": 2,
    "score_batches": 1,
    "eval_samples": 200,
    "engine": "inprocess",
}


def _run(args: argparse.Namespace, name: str, **overrides: Any) -> list[dict[str, Any]]:
    run_config = {
        "num-server-rounds": args.rounds,
        "dataset": args.dataset,
        "data-dir": str(Path(args.data_dir).resolve()) if args.data_dir else "",
        "partition": "dirichlet",
        "model": args.model,
        "local-steps": args.local_steps,
        "lr": args.lr,
        "eval-samples": args.eval_samples,
        "pruning.keep-ratios": args.keep_ratios,
        "pruning.score-batches": args.score_batches,
        "pruning.budget": args.budget,
        "batch-size": args.batch_size,
        **overrides,
    }
    federation = {"num-supernodes": args.devices, "client-resources-num-cpus": 1}
    out = Path(args.out).resolve()
    return run_once(out, name, federation, run_config, timeout=6 * 3600, engine=args.engine)


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    acc = [r["test_accuracy"] for r in rows]
    best = max(range(len(acc)), key=acc.__getitem__)
    return {
        "final_accuracy": round(acc[-1], 4),
        "last3_accuracy": round(statistics.fmean(acc[-3:]), 4),
        "last_accuracy": round(statistics.fmean(acc[-LAST:]), 4),  # LR_RULE's figure
        "best_accuracy": round(acc[best], 4),  # at alpha 0.1 a round swings by points
        "best_round": best + 1,
        "bytes_up_per_round": round(statistics.fmean(r["bytes_up"] for r in rows)),
        "bytes_down_per_round": round(statistics.fmean(r["bytes_down"] for r in rows)),
        "kept_parameters": round(
            statistics.fmean(r.get("mean_kept_fraction", 1.0) for r in rows), 4
        ),
    }


def _mean(per_seed: list[dict[str, Any]], key: str) -> float:
    return round(statistics.fmean(s[key] for s in per_seed), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--alphas", default="0.1,1.0")
    p.add_argument(
        "--variants", default="full,curvature,curvature-signed,magnitude,random,no-reconstruction"
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--keep-ratios", default="1.0,0.75,0.5,0.25", help="cycled over devices")
    p.add_argument(
        "--budget", default="parameters", choices=BUDGETS, help="what a keep ratio is a share of"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--score-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    add_lr_args(p)
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--data-dir", default="", help="default: EdgeFleet's data search")
    p.add_argument(
        "--engine",
        default="simulation",
        choices=ENGINES,
        help="simulation: Flower's Simulation Engine; inprocess: the same apps called directly",
    )
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-pruning"))
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each in its own process (one per alpha, variant and seed); "
        "e.g. on a machine with a GPU and many cores, with --workers 1",
    )
    args = parse_with_smoke(p, SMOKE)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; valid choices: {', '.join(VARIANTS)}")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be at least 1")
    arm_list = lr_arms(p, args, variants)
    if args.jobs > 1 and args.variant_lr:
        # a copy runs one variant, and --variant-lr names the others: it would refuse them
        p.error("--jobs with --variant-lr: run each variant's pick with --jobs 1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.jobs > 1:
        cells = [
            {"alphas": a, "variants": v, "seeds": s}
            for a in args.alphas.split(",")
            for v in variants
            for s in args.seeds.split(",")
        ]
        run_cells(cells, args.jobs, Path(args.out) / "cells")
    settings = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        row: dict[str, Any] = {"alpha": alpha}
        dirs = []
        for label, variant, lr, tagged in arm_list:
            per_seed = []
            for seed in (int(s) for s in args.seeds.split(",")):
                name = f"{args.dataset}-a{alpha:g}-{variant}-s{seed}" + (
                    f"-lr{lr:g}" if tagged else ""
                )
                rows = _run(args, name, alpha=alpha, seed=seed, lr=lr, **VARIANTS[variant])
                per_seed.append(figures(rows))
                dirs.append(Path(args.out) / name)
            row[label] = {
                "lr": lr,
                "final_accuracy": _mean(per_seed, "final_accuracy"),
                "last3_accuracy": _mean(per_seed, "last3_accuracy"),
                "last_accuracy": _mean(per_seed, "last_accuracy"),
                "bytes_up_per_round": round(_mean(per_seed, "bytes_up_per_round")),
                "bytes_down_per_round": round(_mean(per_seed, "bytes_down_per_round")),
                "kept_parameters": _mean(per_seed, "kept_parameters"),
                "seeds": per_seed,
            }
        full = next((a[0] for a in arm_list if a[1] == "full"), None)
        if full is not None:
            for label, *_ in arm_list:
                for way in ("up", "down"):
                    row[label][f"{way}load_vs_full"] = round(
                        row[label][f"bytes_{way}_per_round"] / row[full][f"bytes_{way}_per_round"],
                        3,
                    )
        if args.lrs.strip():
            row["chosen_lr"] = choose_lrs(row, arm_list)
            row["lr_rule"] = LR_RULE
        plot_dir = Path(args.out) / f"plots-{args.dataset}-a{alpha:g}"
        draw_plots([load_run(d) for d in dirs], plot_dir)
        row["plots"] = str(plot_dir)
        settings.append(row)
    print(
        dumps(
            {
                "benchmark": "pruning_claims",
                "sizes": {
                    k: getattr(args, k)
                    for k in ("engine", "dataset", "model", "devices", "keep_ratios", "budget")
                    + ("rounds",)
                    + ("local_steps", "batch_size", "score_batches", "lr", "eval_samples", "seeds")
                    + ("smoke", "lrs")
                }
                | {"variant_lr": {a[1]: a[2] for a in arm_list if args.variant_lr}},
                "machine": machine(),
                "settings": settings,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
