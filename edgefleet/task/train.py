"""Local training and evaluation, shared by the ClientApp and the server's central evaluation.

Both run where the model's parameters are (:mod:`edgefleet.task.accelerator` places the model):
each mini-batch is moved there, and arrays leave as CPU tensors whatever the device. On the CPU
the moves are no-ops, so the CPU path is exactly the one of before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from edgefleet.task.datasets import ArrayDataset


@dataclass(frozen=True)
class TrainResult:
    loss: float  # mean training loss over the local steps
    num_examples: int  # samples seen (steps x batch size, last batch may be short)


def seed_for(*parts: int) -> int:
    """One 63-bit seed from several ints (seed, device, round), stable across processes."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters (or buffers) are; the CPU for a model with neither."""
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def get_arrays(model: nn.Module) -> ArrayRecord:
    """The model's state dict as an ArrayRecord of CPU arrays (``.cpu()`` is a no-op there)."""
    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def set_arrays(model: nn.Module, arrays: ArrayRecord) -> None:
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)


def _batches(n: int, batch_size: int, steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``steps`` mini-batch index sets, drawing epochs of a seeded permutation."""
    out: list[torch.Tensor] = []
    perm = torch.randperm(n, generator=gen)
    pos = 0
    while len(out) < steps:
        if pos >= n:
            perm, pos = torch.randperm(n, generator=gen), 0
        out.append(perm[pos : pos + batch_size])
        pos += batch_size
    return out


def train_local(
    model: nn.Module,
    data: ArrayDataset,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
    proximal_mu: float = 0.0,
    teacher: nn.Module | None = None,
    kl_lambda: float = 0.0,
    correction: dict[str, torch.Tensor] | None = None,
) -> TrainResult:
    """Run ``steps`` mini-batch SGD steps on ``data``; FedProx's proximal term when mu > 0.

    With a ``teacher`` and ``kl_lambda`` > 0 (warm start's Continuous baseline, arXiv
    2410.05662) the loss adds kl_lambda x KL(softmax(teacher(x)) || softmax(model(x))),
    averaged over the batch, the teacher frozen: the reference's ``_train_continuous``.
    ``correction`` (SCAFFOLD's c - c_i, by parameter name) is added to every gradient.
    The teacher may be the full model while ``model`` is a pruned submodel: only their
    outputs meet.
    """
    if len(data) == 0:
        raise ValueError("cannot train on an empty partition")
    if kl_lambda <= 0:
        teacher = None
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same batches on any device
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    dev = model_device(model)
    if teacher is not None:
        teacher.to(dev).eval()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    total, seen = 0.0, 0
    for idx in _batches(len(data), batch_size, steps, gen):
        opt.zero_grad(set_to_none=True)
        xb, yb = x[idx].to(dev), y[idx].to(dev)
        logits = model(xb)
        loss = loss_fn(logits, yb)
        if teacher is not None:
            with torch.no_grad():
                target = torch.softmax(teacher(xb), dim=1)
            kl = nn.functional.kl_div(
                torch.log_softmax(logits, dim=1), target, reduction="batchmean"
            )
            loss = loss + kl_lambda * kl
        if anchor:
            prox = sum(
                ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
            )
            loss = loss + 0.5 * proximal_mu * prox
        loss.backward()
        if correction:
            for name, p in model.named_parameters():
                if p.grad is not None and name in correction:
                    p.grad.add_(correction[name])
        opt.step()
        total += float(loss.detach()) * len(idx)
        seen += len(idx)
    return TrainResult(loss=total / seen, num_examples=seen)


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy
    accuracy: float
    balanced_accuracy: float  # mean per-class recall over the classes present
    per_class: dict[int, tuple[int, int]] = field(default_factory=dict)  # class: (correct, n)


@torch.no_grad()
def evaluate(model: nn.Module, data: ArrayDataset, batch_size: int = 100) -> EvalResult:
    """Loss, accuracy and balanced accuracy of ``model`` on ``data`` (NaN when empty).

    Balanced accuracy is what to quote on imbalanced sets (BCCD, PneumoniaMNIST). Batches of
    100 measured 2.7x faster than 1000 for the SmallCNN on 2 cores (cache-sized tensors)."""
    if len(data) == 0:
        return EvalResult(float("nan"), float("nan"), float("nan"))
    model.eval()
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    dev = model_device(model)
    loss_sum, preds = 0.0, []
    for start in range(0, len(data), batch_size):
        logits = model(x[start : start + batch_size].to(dev))
        target = y[start : start + batch_size].to(dev)
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        preds.append(logits.argmax(1).cpu())
    correct = (torch.cat(preds) == y).numpy()
    labels = y.numpy()
    # float64 throughout: float32 means print as 0.23000000417232513
    per_class = {
        int(c): (int(correct[labels == c].sum()), int((labels == c).sum()))
        for c in np.unique(labels)
    }
    recalls = [ok / n for ok, n in per_class.values()]
    return EvalResult(
        loss_sum / len(data), float(correct.mean()), sum(recalls) / len(recalls), per_class
    )
