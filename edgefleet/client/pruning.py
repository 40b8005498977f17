"""CA-HFP on the client: the submodel a device trains this round.

A device with keep ratio < 1 scores every weight of the global model it was sent on a few
local mini-batches (``pruning.criterion``; curvature by default, in the form
``pruning.score``), keeps the best-scoring channels of every group, as many as its keep ratio
allows (a share of parameters by default, ``pruning.budget``), and trains a physically smaller
copy of the model
(:meth:`~edgefleet.pruning.submodel.PruningPlan.extract`). When the server sent a compact
slice with the channels to keep (``pruning.compact-download``), the device trains that
submodel as it is, without scoring.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from edgefleet.client.device import Device
from edgefleet.pruning.importance import weight_scores
from edgefleet.pruning.names import POSITIONAL_CRITERIA
from edgefleet.pruning.widthslice import prefix_kept, rolling_kept
from edgefleet.pruning.wire import kept_from_record
from edgefleet.task.train import TrainResult, set_arrays

Kept = dict[str, np.ndarray]


def score_batches(device: Device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pruning.score-batches`` seeded mini-batches of the local training data."""
    cfg, data = device.config, device.train_data
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen).numpy()
    size = cfg.train.batch_size
    out = []
    for b in range(cfg.pruning.score_batches):
        idx = order[b * size : (b + 1) * size]
        if len(idx) == 0:
            break  # fewer samples than batches: score on what there is
        out.append((torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])))
    return out


def round_model(
    device: Device,
    arrays: ArrayRecord,
    kept_in: ArrayRecord | None,
    seed: int,
    server_round: int = 1,
) -> tuple[nn.Module, Kept | None]:
    """The model to train this round and the channels it keeps (None: the full model).

    Raises ValueError when the server's kept channels or compact arrays do not fit."""
    if kept_in is not None:
        plan = device.plan
        kept = kept_from_record(kept_in)
        reason = plan.validate_kept(kept)
        if reason:
            raise ValueError(f"the server's kept channels: {reason}")
        model = plan.extract(device.model, kept)
        try:
            set_arrays(model, arrays)
        except RuntimeError as err:  # load_state_dict's size mismatch
            raise ValueError(f"compact arrays do not fit the kept channels: {err}") from None
        return model, kept
    set_arrays(device.model, arrays)
    keep = device.profile.keep_ratio
    if keep >= 1.0:
        return device.model, None
    p, plan = device.config.pruning, device.plan  # the plan only where something is pruned
    if p.criterion in POSITIONAL_CRITERIA:  # HeteroFL's / FedRolex's slices: no scores
        counts = plan.channel_counts(keep, p.budget)
        if p.criterion == "prefix":
            kept = prefix_kept(counts)
        else:
            kept = rolling_kept(plan.groups, counts, server_round)
        return plan.extract(device.model, kept), kept
    scores = weight_scores(
        device.model, score_batches(device, seed), p.criterion, p.hessian, seed, score=p.score
    )
    kept = plan.select(plan.group_scores(scores), keep, p.budget)
    return plan.extract(device.model, kept), kept


def ordered_dropout_round(
    device: Device, arrays: ArrayRecord, data: Any, seed: int, lr: float
) -> tuple[nn.Module, Kept | None, TrainResult]:
    """FjORD's round (``pruning.criterion = "ordered-dropout"``): ordered-dropout steps on the
    device's model from ``arrays``, widths the fleet's keep ratios up to the device's own;
    the p_max prefix to send and its kept channels (None: the full model)."""
    # lazy: torch_pruning (via ordered_dropout's pruning.submodel) only for FjORD runs
    from edgefleet.pruning.ordered_dropout import train_ordered_dropout

    set_arrays(device.model, arrays)
    cfg = device.config
    p = cfg.pruning
    widths = p.keep_ratios or (p.keep_ratio,)
    model, kept, result, _ = train_ordered_dropout(
        device.model,
        device.plan,
        data,
        p_max=device.profile.keep_ratio,
        widths=widths,
        budget=p.budget,
        steps=cfg.train.local_steps,
        batch_size=cfg.train.batch_size,
        lr=lr,
        seed=seed,
    )
    return model, kept, result


def parameter_fraction(model: nn.Module, full: nn.Module) -> float:
    """The share of the full model's parameters that ``model`` holds."""
    return sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in full.parameters())
