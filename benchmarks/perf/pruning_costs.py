"""What a CA-HFP submodel saves: parameters, upload bytes and local training time per keep ratio.

For each keep ratio (a share of ``--budget``: parameters by default, compute, or every group's
channels) the channels are chosen with ``--criterion`` (the costs do not depend on which
channels, only on how many), the submodel is cut with :meth:`PruningPlan.extract` and:

- ``params_fraction``: submodel parameters / full-model parameters (counted on the submodel);
- ``compute_fraction``: multiply-accumulates of one forward pass, submodel / full model (the
  plan's count, convolutions and linear layers); ``channel_fraction``: channels kept over all
  groups;
- ``upload_fraction``: bytes a client uploads (compact state dict, buffers included, plus the
  kept-channel int64 arrays) / bytes of the full state dict;
- ``step_time_fraction`` (and ``speedup`` = its inverse): time of one SGD step (forward,
  backward, momentum update) on random data of ``--batch-size`` samples, submodel over full
  model. In every repeat, ``--steps`` steps of the full model and of the submodel alternate
  (after 3 warm-up steps each), so both see the same load on a shared machine; the figure is
  the median over ``--repeats`` of the per-repeat ratios. ``step_ms`` are medians of raw times.

It also times the pruning machinery itself: building the plan, scoring one batch with the
curvature criterion (Fisher; the first call pays torch.func's set-up, the second does not),
``extract``, and ``index_maps`` (first call and cached call). ``loadavg`` (start, end) shows
how busy the machine was. Prints one JSON line on stdout; progress goes to stderr. Examples::

    .venv/bin/python -m benchmarks.perf.pruning_costs                        # smallcnn, 1x28x28
    .venv/bin/python -m benchmarks.perf.pruning_costs --model resnet8 --input 3,32,32
    .venv/bin/python -m benchmarks.perf.pruning_costs --budget channels   # the earlier meaning
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from edgefleet.pruning.importance import CRITERIA, weight_scores
from edgefleet.pruning.names import BUDGETS
from edgefleet.pruning.submodel import PruningPlan
from edgefleet.task.models import build_model


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _Trainer:
    """One model with its own SGD optimiser; ``step`` times one SGD step in seconds."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model, self.x, self.y = model.train(), x, y
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        for _ in range(3):  # warm-up: allocator, kernel selection, momentum buffers
            self.step()

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.loss_fn(self.model(self.x), self.y).backward()
        self.opt.step()
        return time.perf_counter() - t0


def _paired_times(full: _Trainer, sub: _Trainer, steps: int) -> tuple[float, float]:
    """Seconds per step of each, their steps alternating so both see the same machine load
    (other processes on a shared machine change its speed within seconds)."""
    tf = ts = 0.0
    for _ in range(steps):
        tf += full.step()
        ts += sub.step()
    return tf / steps, ts / steps


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--input", default="1,28,28", help="C,H,W of one sample")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--ratios", default="1.0,0.75,0.5,0.25", help="comma-separated keep ratios")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=30, help="timed SGD steps per measurement")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--criterion", default="magnitude", choices=CRITERIA)
    p.add_argument("--budget", default="parameters", choices=BUDGETS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = tuple(int(v) for v in args.input.split(","))
    if len(shape) != 3:
        p.error("--input must be C,H,W")
    input_shape = (shape[0], shape[1], shape[2])
    ratios = [float(r) for r in args.ratios.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load_start = os.getloadavg()[0]

    full = build_model(args.model, input_shape, args.classes)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch_size, *input_shape, generator=gen)
    y = torch.randint(0, args.classes, (args.batch_size,), generator=gen)

    t = time.perf_counter()
    plan = PruningPlan(full, x[:1])
    plan_s = time.perf_counter() - t
    curvature_s = []  # the first call pays torch.func's one-off set-up, once per process
    for _ in range(2):
        t = time.perf_counter()
        weight_scores(full, [(x, y)], "curvature", "fisher")
        curvature_s.append(time.perf_counter() - t)
    scores = plan.group_scores(weight_scores(full, [(x, y)], args.criterion, seed=args.seed))
    _log(f"{args.model}: groups {plan.groups}; plan {plan_s:.3f} s, curvature {curvature_s} s")

    full_params, full_bytes = _params(full), _state_bytes(full)
    rows: list[dict[str, Any]] = []
    submodels: list[nn.Module] = []
    for ratio in ratios:
        kept = plan.select(scores, ratio, args.budget)
        t = time.perf_counter()
        sub = plan.extract(full, kept)
        extract_s = time.perf_counter() - t
        t = time.perf_counter()
        plan.index_maps(kept)
        maps_s = time.perf_counter() - t
        t = time.perf_counter()
        plan.index_maps(kept)
        maps_cached_s = time.perf_counter() - t
        upload = _state_bytes(sub) + sum(k.nbytes for k in kept.values())
        submodels.append(sub)
        rows.append(
            {
                "keep_ratio": ratio,
                "channels": {g: len(k) for g, k in kept.items()},
                "params": _params(sub),
                "params_fraction": round(_params(sub) / full_params, 4),
                "compute_fraction": round(plan.shares(kept)["compute"], 4),
                "channel_fraction": round(
                    sum(len(k) for k in kept.values()) / sum(plan.groups.values()), 4
                ),
                "upload_bytes": upload,
                "upload_fraction": round(upload / full_bytes, 4),
                "extract_ms": _ms(extract_s),
                "index_maps_ms": _ms(maps_s),
                "index_maps_cached_ms": _ms(maps_cached_s),
            }
        )

    full_trainer = _Trainer(full, x, y)
    trainers = [_Trainer(sub, x, y) for sub in submodels]
    full_times: list[float] = []
    sub_times: list[list[float]] = [[] for _ in ratios]
    fractions: list[list[float]] = [[] for _ in ratios]
    for rep in range(args.repeats):
        for i, trainer in enumerate(trainers):
            tf, ts = _paired_times(full_trainer, trainer, args.steps)
            full_times.append(tf)
            sub_times[i].append(ts)
            fractions[i].append(ts / tf)
            _log(f"repeat {rep} keep {ratios[i]}: full {tf * 1e3:.1f} ms, sub {ts * 1e3:.1f} ms")
    for row, times, frac in zip(rows, sub_times, fractions, strict=True):
        median = statistics.median(frac)
        row["step_ms"] = _ms(statistics.median(times))
        row["step_time_fraction"] = round(median, 4)
        row["speedup"] = round(1 / median, 3)

    print(
        json.dumps(
            {
                "benchmark": "pruning_costs",
                "model": args.model,
                "input": list(input_shape),
                "classes": args.classes,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "threads": args.threads,
                "repeats": args.repeats,
                "criterion": args.criterion,
                "budget": args.budget,
                "full_params": full_params,
                "full_state_bytes": full_bytes,
                "full_step_ms": _ms(statistics.median(full_times)),
                "plan_build_ms": _ms(plan_s),
                "curvature_scores_first_ms": _ms(curvature_s[0]),
                "curvature_scores_ms": _ms(curvature_s[1]),
                "groups": plan.groups,
                "ratios": rows,
                "loadavg": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                "torch": torch.__version__,
                "numpy": np.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
