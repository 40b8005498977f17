"""Model, data and training, as Flower's PyTorch quickstart has them (scikit-learn's digits,
which ship with the wheel, instead of a download)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A device's share of the first 1,400 images (the rest is the server's test set)."""
    x, y = _digits()
    idx = np.arange(1400)[partition_id::num_partitions]
    return torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _digits()
    return torch.from_numpy(x[1400:]), torch.from_numpy(y[1400:])


def train(net: Net, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int) -> float:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(epochs):
        for batch in torch.randperm(len(y)).split(16):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            opt.step()
    return float(loss)


def test(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = net(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())
