"""FjORD's ordered dropout on the device: every local step trains a nested prefix submodel.

"FjORD: Fair and Accurate Federated Learning under Heterogeneous Targets with Ordered
Dropout", Horvath, Laskaridis, Almeida, Leontiadis, Venieris, Lane, NeurIPS 2021 (arXiv
2102.13451). A device of capability p_max trains, at every local step, the submodel that
keeps the first ceil(p k) channels of every layer (HeteroFL's prefix slice, here
:func:`~edgefleet.pruning.widthslice.prefix_kept` at the width ``p``) with p drawn uniformly
from the widths p <= p_max of a discrete set; the step updates that prefix of the device's
model and nothing else. It replies with its p_max prefix, and the server averages every entry
over the devices that hold it, weighted by their examples (``pruning.reconstruction =
"elementwise"``, FjORD's nested aggregation). Smaller widths are thus trained by every device,
so the global model can be cut to any width afterwards.

Here the set of widths is the fleet's keep ratios (``pruning.keep-ratios``, or the one
``pruning.keep-ratio``), with the same budgets as CA-HFP's; p_max is the device's keep ratio.
Each step is one plain SGD step (no momentum: the momentum buffer would belong to a
different width every step) on one mini-batch. FjORD's optional self-distillation from the
p_max model is not done.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from edgefleet.pruning.submodel import PruningPlan
from edgefleet.pruning.widthslice import prefix_kept
from edgefleet.task.datasets import ArrayDataset
from edgefleet.task.train import TrainResult, train_local

Kept = dict[str, np.ndarray]


def allowed_widths(widths: Sequence[float], p_max: float) -> list[float]:
    """The widths a device of capability ``p_max`` samples from: those of ``widths`` up to
    ``p_max``, and ``p_max`` itself (sorted, distinct)."""
    return sorted({float(w) for w in widths if w <= p_max} | {float(p_max)})


def write_back(model: nn.Module, sub: nn.Module, plan: PruningPlan, kept: Kept) -> None:
    """Copy the submodel's tensors into their positions in ``model`` (in place)."""
    maps = plan.index_maps(kept)
    full = model.state_dict()
    with torch.no_grad():
        for key, value in sub.state_dict().items():
            target = full[key]
            flat = target.view(-1)
            index = torch.from_numpy(np.array(maps[key])).to(flat.device)  # (maps are read-only)
            flat[index] = value.reshape(-1).to(target.dtype)


def train_ordered_dropout(
    model: nn.Module,
    plan: PruningPlan,
    data: ArrayDataset,
    *,
    p_max: float,
    widths: Sequence[float],
    budget: str,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[nn.Module, Kept | None, TrainResult, list[float]]:
    """``steps`` ordered-dropout steps on ``model`` (modified in place); returns the p_max
    submodel to send (``model`` itself and None at p_max = 1), its kept channels, the
    training figures, and the width of every step."""
    choices = allowed_widths(widths, p_max)
    rng = np.random.default_rng(seed)
    drawn, total, seen = [], 0.0, 0
    for step in range(steps):
        p = choices[int(rng.integers(len(choices)))]
        drawn.append(p)
        kept = prefix_kept(plan.channel_counts(p, budget)) if p < 1.0 else None
        sub = model if kept is None else plan.extract(model, kept)
        res = train_local(
            sub, data, steps=1, batch_size=batch_size, lr=lr, momentum=0.0, seed=seed + step
        )
        if kept is not None:
            write_back(model, sub, plan, kept)
        total += res.loss * res.num_examples
        seen += res.num_examples
    result = TrainResult(loss=total / max(1, seen), num_examples=seen)
    if p_max >= 1.0:
        return model, None, result, drawn
    kept_max = prefix_kept(plan.channel_counts(p_max, budget))
    return plan.extract(model, kept_max), kept_max, result, drawn
