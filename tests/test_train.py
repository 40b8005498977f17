"""Local training and evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgefleet.task.datasets import ArrayDataset
from edgefleet.task.models import build_model
from edgefleet.task.train import evaluate, get_arrays, seed_for, set_arrays, train_local


def _data(n: int = 64, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(
        rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)
    )


def _train(seed: int, mu: float = 0.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("smallcnn", (1, 8, 8), 3)
    res = train_local(
        model, _data(), steps=5, batch_size=16, lr=0.1, momentum=0.9, seed=seed, proximal_mu=mu
    )
    assert res.num_examples == 80 and np.isfinite(res.loss)
    return model.state_dict()


def test_training_is_deterministic_in_seed() -> None:
    a, b, c = _train(1), _train(1), _train(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_proximal_term_keeps_weights_closer() -> None:
    torch.manual_seed(0)
    start = build_model("smallcnn", (1, 8, 8), 3).state_dict()
    free, prox = _train(1), _train(1, mu=2.0)

    def dist(sd: dict[str, torch.Tensor]) -> float:
        return sum(float(((sd[k] - start[k]) ** 2).sum()) for k in start)

    assert dist(prox) < dist(free)


def test_evaluate_by_hand() -> None:
    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # predicts class = first pixel's value
            return nn.functional.one_hot(x[:, 0, 0, 0].long(), 2).float() * 10

    x = np.zeros((5, 1, 1, 1), np.float32)
    x[:, 0, 0, 0] = [0, 0, 0, 1, 0]  # predictions
    y = np.array([0, 0, 0, 1, 1])  # class 0: 3/3 right, class 1: 1/2 right
    res = evaluate(Fixed(), ArrayDataset(x, y))
    assert res.accuracy == pytest.approx(4 / 5)
    assert res.balanced_accuracy == pytest.approx((1.0 + 0.5) / 2)
    assert np.isnan(evaluate(Fixed(), ArrayDataset(x[:0], y[:0])).accuracy)


def test_arrays_round_trip_and_seed_for() -> None:
    model = build_model("resnet8", (1, 8, 8), 3)
    arrays = get_arrays(model)
    other = build_model("resnet8", (1, 8, 8), 3)
    set_arrays(other, arrays)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    assert seed_for(0, 1, 2) == seed_for(0, 1, 2) != seed_for(0, 2, 1)


def test_empty_partition_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        train_local(
            build_model("linear", (1, 8, 8), 3),
            _data(0),
            steps=1,
            batch_size=4,
            lr=0.1,
            momentum=0.0,
            seed=0,
        )
