"""Model, data and training, as Flower's PyTorch quickstart writes them.

The data are scikit-learn's handwritten digits (8x8 images, ten classes), which ship with
scikit-learn: the example runs without a download. Each device holds every
``num-partitions``-th image of the first 1,400; the server keeps the other 397 for its
evaluation.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

TRAIN_IMAGES = 1400
# A round costs a device this many battery slots of training (Omega) plus one to send: the
# battery mod (client_app.py) charges it and the server (server_app.py) advances its clock by it.
TRAIN_SLOTS = 3


class Net(nn.Module):
    """A small CNN for 8x8 images (two conv layers, two dense layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = (x[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return x, y[order].astype(np.int64)


def load_data(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device ``partition_id``'s share of the training images."""
    x, y = _digits()
    idx = np.arange(TRAIN_IMAGES)[partition_id::num_partitions]
    return torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The server's held-out images."""
    x, y = _digits()
    return torch.from_numpy(x[TRAIN_IMAGES:]), torch.from_numpy(y[TRAIN_IMAGES:])


def train(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, seed: int
) -> float:
    """Plain SGD over the device's data; the last batch's loss."""
    torch.manual_seed(seed)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    loss = torch.tensor(0.0)
    for _ in range(epochs):
        for batch in torch.randperm(len(y)).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            opt.step()
    return float(loss.detach())


def test(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Loss and accuracy of ``net`` on ``(x, y)``."""
    net.eval()
    with torch.no_grad():
        out = net(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())
