"""How differently the pruning criteria choose channels, on a model from a finished run.

CA-HFP's curvature score comes in two forms (``pruning.score``): the Taylor estimate
``|g w - h w^2 / 2|`` and the seed's signed ``g w + h w^2``. This loads the global model of a
run (``--run``: a run folder of ``edgefleet run`` or a claims benchmark, with its
``summary.json`` and ``checkpoint.pkl``), rebuilds the run's devices exactly as the ClientApp
does (same partition, same scoring batches for ``--round``), and for every device with a keep
ratio below 1 reports:

- ``overlap``: per pair of criteria (``taylor``, ``signed``, ``magnitude``, ``random``), the
  Jaccard overlap of the channels they keep (all groups pooled: shared / either);
- ``top2_class_share``: how non-IID the device is (its two largest classes' share);
- ``signed_negative``: the share of channels whose signed score (summed over the channel) is
  negative, and ``first_order_share``: the share of the signed scores' total magnitude that
  comes from ``g w`` (the rest is ``h w^2``): where it is small the signed score is a
  Fisher-weighted magnitude.

Prints one JSON line. Example::

    python -m benchmarks.claims.pruning_scores --run runs/cifar/cifar10-a0.1-full-s0 \
        --keep-ratio 0.25
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.client.device import get_device
from edgefleet.client.pruning import score_batches
from edgefleet.pruning.importance import fisher_diagonal, hutchinson_diagonal, weight_scores
from edgefleet.pruning.names import BUDGETS
from edgefleet.server.checkpoint import load_checkpoint
from edgefleet.task.train import seed_for, set_arrays

CRITERIA = ("taylor", "signed", "magnitude", "random")


def _pooled(kept: dict[str, np.ndarray]) -> set[tuple[str, int]]:
    return {(g, int(c)) for g, idx in kept.items() for c in idx}


def _hessian_term(device: Any, batches: list, seed: int) -> dict[str, np.ndarray]:
    """``h w^2`` per weight, h estimated as the client estimates it (sample-weighted over
    the batches), so that ``g w`` = signed score - ``h w^2``."""
    cfg = device.config.pruning
    total = sum(len(y) for _, y in batches)
    weights = {k: v.detach().double().numpy() for k, v in device.model.named_parameters()}
    h = {k: np.zeros(w.shape) for k, w in weights.items()}
    for b, (x, y) in enumerate(batches):
        if cfg.hessian == "fisher":
            hb = fisher_diagonal(device.model, x, y)
        else:
            hb = hutchinson_diagonal(device.model, x, y, 16, seed + b)
        for k in weights:
            h[k] += hb[k].double().numpy() * len(y) / total
    return {k: h[k] * w**2 for k, w in weights.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished run's folder")
    p.add_argument("--devices", type=int, default=4, help="the run's number of devices")
    p.add_argument("--keep-ratio", type=float, default=0.0, help="0: each device's own")
    p.add_argument("--budget", default="", help="default: the run's pruning.budget")
    p.add_argument("--round", type=int, default=1, help="the round whose scoring batches to use")
    args = p.parse_args()
    run = Path(args.run)
    run_config: dict[str, Any] = json.loads((run / "summary.json").read_text())["config"]
    budget = args.budget or run_config.get("pruning.budget", "parameters")
    if budget not in BUDGETS:
        p.error(f"unknown budget {budget!r}; valid choices: {', '.join(BUDGETS)}")
    ckpt = load_checkpoint(run / "checkpoint.pkl")
    t0 = time.monotonic()
    devices = []
    for pid in range(args.devices):
        node = {"partition-id": pid, "num-partitions": args.devices}
        device = get_device(run_config, node)
        keep = args.keep_ratio or device.profile.keep_ratio
        if keep >= 1.0:
            continue
        set_arrays(device.model, ckpt.array_record())
        seed = seed_for(device.config.seed, pid, args.round)
        batches = score_batches(device, seed)
        plan, hessian = device.plan, device.config.pruning.hessian
        raw = {
            "taylor": weight_scores(device.model, batches, "curvature", hessian, seed),
            "signed": weight_scores(
                device.model, batches, "curvature", hessian, seed, score="signed"
            ),
            "magnitude": weight_scores(device.model, batches, "magnitude"),
            "random": weight_scores(device.model, batches, "random", seed=seed),
        }
        group = {c: plan.group_scores(v) for c, v in raw.items()}
        kept = {c: _pooled(plan.select(v, keep, budget)) for c, v in group.items()}
        signed = np.concatenate(list(group["signed"].values()))
        hw2 = _hessian_term(device, batches, seed)
        gw = {k: raw["signed"][k].double().numpy() - v for k, v in hw2.items()}
        first = sum(float(np.abs(v).sum()) for v in gw.values())
        second = sum(float(np.abs(v).sum()) for v in hw2.values())
        devices.append(
            {
                "partition": pid,
                "keep_ratio": keep,
                "top2_class_share": round(
                    float(np.sort(np.bincount(device.train_data.y))[-2:].sum())
                    / len(device.train_data.y),
                    3,
                ),
                "overlap": {
                    f"{a}/{b}": round(len(kept[a] & kept[b]) / len(kept[a] | kept[b]), 3)
                    for a, b in itertools.combinations(CRITERIA, 2)
                },
                "signed_negative": round(float((signed < 0).mean()), 3),
                "first_order_share": round(first / (first + second), 3),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "pruning_scores",
                "run": str(run),
                "round": args.round,
                "budget": budget,
                "devices": devices,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
