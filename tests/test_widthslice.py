"""HeteroFL's static and FedRolex's rolling width slices (``pruning.criterion = "prefix" |
"rolling"`` with ``pruning.reconstruction = "elementwise"``) against their papers' rules,
written out in NumPy on a tiny MLP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from edgefleet.config import DEFAULTS, ConfigError, parse_run_config
from edgefleet.pruning.importance import weight_scores
from edgefleet.pruning.reconstruct import elementwise_average
from edgefleet.pruning.submodel import PruningPlan
from edgefleet.pruning.widthslice import prefix_kept, rolling_kept
from tests.fakes import FakeGrid


def test_slices_by_hand() -> None:
    np.testing.assert_array_equal(prefix_kept({"a": 2})["a"], [0, 1])
    groups, counts = {"a": 4, "b": 3}, {"a": 2, "b": 3}
    # round t starts the window at (t - 1) mod n and wraps around
    assert {g: list(v) for g, v in rolling_kept(groups, counts, 1).items()} == {
        "a": [0, 1],
        "b": [0, 1, 2],
    }
    assert list(rolling_kept(groups, counts, 4)["a"]) == [0, 3]  # channels 3, 0
    assert list(rolling_kept(groups, counts, 6)["a"]) == [1, 2]  # (6 - 1) mod 4 = 1
    with pytest.raises(ValueError, match="server_round"):
        rolling_kept(groups, counts, 0)
    with pytest.raises(ValueError, match="by position"):
        weight_scores(nn.Linear(2, 2), [], "prefix")


def _mlp() -> tuple[nn.Module, PruningPlan]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, PruningPlan(model, torch.zeros(1, 3))


def _numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}


def _by_hand(
    glob: dict[str, np.ndarray], clients: list[tuple[np.ndarray, float]]
) -> dict[str, np.ndarray]:
    """HeteroFL's aggregation (arXiv 2010.01264, Eq. 2 and the authors' code): with hidden
    channel set K_i of client i (which trained the global model plus ``shift`` on every entry
    it holds), each entry is the mean over the clients holding it; others stay global."""
    out = {k: v.copy() for k, v in glob.items()}
    num = {k: np.zeros_like(v) for k, v in glob.items()}
    den = {k: np.zeros_like(v) for k, v in glob.items()}
    for kept, shift in clients:
        masks = {
            "0.weight": np.zeros((4, 3), bool),
            "0.bias": np.zeros(4, bool),
            "2.weight": np.zeros((2, 4), bool),
            "2.bias": np.ones(2, bool),  # the classifier's outputs are never pruned
        }
        masks["0.weight"][kept, :] = True
        masks["0.bias"][kept] = True
        masks["2.weight"][:, kept] = True
        for k, m in masks.items():
            num[k][m] += glob[k][m] + shift
            den[k][m] += 1
    for k in out:
        held = den[k] > 0
        out[k][held] = num[k][held] / den[k][held]
    return out


def _round(
    model: nn.Module, plan: PruningPlan, kepts: list[dict[str, np.ndarray]], shifts: list[float]
) -> dict[str, np.ndarray]:
    glob = _numpy(model)
    updates = []
    for kept, shift in zip(kepts, shifts, strict=True):
        sub = plan.extract(model, kept)
        compact = {k: v + shift for k, v in _numpy(sub).items()}  # "training": + shift
        updates.append((compact, plan.index_maps(kept), 1.0))
    return elementwise_average(glob, updates)


def test_heterofl_static_slices_aggregate_as_the_paper() -> None:
    model, plan = _mlp()
    (group,) = plan.groups
    full = {group: np.arange(4)}
    half = prefix_kept(plan.channel_counts(0.5, "channels"))
    np.testing.assert_array_equal(half[group], [0, 1])
    got = _round(model, plan, [full, half], [1.0, 3.0])
    expected = _by_hand(_numpy(model), [(np.arange(4), 1.0), (half[group], 3.0)])
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, err_msg=k)
    # channels 0, 1 averaged over both (+2), channels 2, 3 from the full client only (+1)
    np.testing.assert_allclose(got["0.bias"] - _numpy(model)["0.bias"], [2, 2, 1, 1], rtol=1e-6)


def test_fedrolex_window_rolls_and_every_channel_gets_trained() -> None:
    model, plan = _mlp()
    (group,) = plan.groups
    counts = plan.channel_counts(0.5, "channels")
    trained = set()
    for t in (1, 2, 3, 4):
        kept = rolling_kept(plan.groups, counts, t)
        trained |= set(kept[group].tolist())
        got = _round(model, plan, [kept, kept], [1.0, 3.0])
        expected = _by_hand(_numpy(model), [(kept[group], 1.0), (kept[group], 3.0)])
        for k in expected:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, err_msg=f"{t} {k}")
    # round 4's window is channels 3, 0: the bias moved by +2 there only
    np.testing.assert_allclose(got["0.bias"] - _numpy(model)["0.bias"], [2, 0, 0, 2], rtol=1e-6)
    assert trained == {0, 1, 2, 3}  # HeteroFL's static half never trains channels 2, 3


@pytest.mark.parametrize("criterion", ["prefix", "rolling"])
def test_edgefleet_client_cuts_the_positional_slice(criterion: str) -> None:
    """EdgeFleet's ClientApp, keep ratio 0.5 of the channels: the reply's kept channels are
    HeteroFL's prefix / FedRolex's window of round 3."""
    from edgefleet.client.app import app
    from edgefleet.client.device import get_device
    from edgefleet.pruning.wire import KEPT
    from edgefleet.simulation.inprocess import node_contexts
    from edgefleet.task.train import get_arrays

    FakeGrid({})  # sets the task identity that building messages needs
    run_config = {
        **DEFAULTS,
        "local-steps": 1,
        "batch-size": 4,
        "pruning.keep-ratio": 0.5,
        "pruning.budget": "channels",
        "pruning.criterion": criterion,
        "pruning.reconstruction": "elementwise",
    }
    ctx = node_contexts(run_config, 4)[1]
    device = get_device(ctx.run_config, ctx.node_config)
    arrays = get_arrays(device.model)
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 3})})
    reply = app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    kept = {g: a.numpy() for g, a in reply.content[KEPT].items()}
    counts = device.plan.channel_counts(0.5, "channels")
    if criterion == "prefix":
        expected = prefix_kept(counts)
    else:
        expected = rolling_kept(device.plan.groups, counts, 3)
    assert kept.keys() == expected.keys()
    for g in kept:
        np.testing.assert_array_equal(kept[g], expected[g])


def test_rolling_with_compact_download_is_refused() -> None:
    with pytest.raises(ConfigError, match="window moves every round"):
        parse_run_config({"pruning.criterion": "rolling", "pruning.compact-download": True})
    with pytest.raises(ConfigError, match="random, prefix, rolling"):
        parse_run_config({"pruning.criterion": "heterofl"})


# ----------------------------------------------------------------------------- FjORD


def test_ordered_dropout_step_is_an_sgd_step_on_the_drawn_prefix_only() -> None:
    """FjORD's local step at width p: plain SGD on the p-prefix submodel, written back into
    its positions; every other entry of the device's model is left as it was."""
    from edgefleet.pruning.ordered_dropout import allowed_widths, train_ordered_dropout
    from edgefleet.task.datasets import ArrayDataset

    model, plan = _mlp()
    (group,) = plan.groups
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(4, 3)).astype(np.float32), np.array([0, 1, 1, 0]))
    before = _numpy(model)
    # By hand: one full-batch step on the first 2 hidden channels, with torch's autograd.
    w1, b1 = (torch.tensor(before[k][:2], requires_grad=True) for k in ("0.weight", "0.bias"))
    w2 = torch.tensor(before["2.weight"][:, :2], requires_grad=True)
    b2 = torch.tensor(before["2.bias"], requires_grad=True)
    x, y = torch.from_numpy(data.x).double(), torch.from_numpy(data.y)
    loss = nn.functional.cross_entropy(torch.relu(x @ w1.T + b1) @ w2.T + b2, y)
    loss.backward()
    sub, kept, result, drawn = train_ordered_dropout(
        model, plan, data, p_max=0.5, widths=[0.5, 1.0], budget="channels",
        steps=1, batch_size=4, lr=0.1, seed=3,
    )  # fmt: skip
    assert drawn == [0.5] and result.num_examples == 4
    after = _numpy(model)
    step = {k: (t - 0.1 * t.grad).detach().numpy() for k, t in {"w1": w1, "w2": w2}.items()}
    np.testing.assert_allclose(after["0.weight"][:2], step["w1"], rtol=1e-5)
    np.testing.assert_allclose(after["2.weight"][:, :2], step["w2"], rtol=1e-5)
    np.testing.assert_allclose(after["2.bias"], (b2 - 0.1 * b2.grad).detach().numpy(), rtol=1e-5)
    np.testing.assert_array_equal(after["0.weight"][2:], before["0.weight"][2:])
    np.testing.assert_array_equal(after["2.weight"][:, 2:], before["2.weight"][:, 2:])
    # the reply is the p_max prefix
    np.testing.assert_array_equal(kept[group], [0, 1])  # type: ignore[index]
    np.testing.assert_allclose(_numpy(sub)["0.weight"], after["0.weight"][:2])
    assert allowed_widths([0.25, 0.5, 1.0], 0.5) == [0.25, 0.5]
    assert allowed_widths([0.25, 1.0], 0.75) == [0.25, 0.75]


def test_ordered_dropout_draws_every_allowed_width_and_trains_nested_slices() -> None:
    from edgefleet.pruning.ordered_dropout import train_ordered_dropout
    from edgefleet.task.datasets import ArrayDataset

    model, plan = _mlp()
    rng = np.random.default_rng(1)
    data = ArrayDataset(rng.normal(size=(8, 3)).astype(np.float32), rng.integers(0, 2, 8))
    before = _numpy(model)
    sub, kept, _, drawn = train_ordered_dropout(
        model, plan, data, p_max=1.0, widths=[0.25, 0.5, 1.0], budget="channels",
        steps=12, batch_size=4, lr=0.1, seed=0,
    )  # fmt: skip
    assert set(drawn) == {0.25, 0.5, 1.0} and kept is None and sub is model
    # the output layer is in every width's submodel: it moved (and stayed finite)
    assert not np.allclose(_numpy(model)["2.bias"], before["2.bias"])
    assert all(np.isfinite(v).all() for v in _numpy(model).values())
    again, _, _, drawn_again = train_ordered_dropout(
        _mlp()[0], plan, data, p_max=1.0, widths=[0.25, 0.5, 1.0], budget="channels",
        steps=12, batch_size=4, lr=0.1, seed=0,
    )  # fmt: skip
    assert drawn_again == drawn  # seeded
    np.testing.assert_array_equal(_numpy(again)["0.bias"], _numpy(model)["0.bias"])


def test_edgefleet_client_trains_ordered_dropout_and_refuses_what_does_not_compose() -> None:
    from edgefleet.client.app import app
    from edgefleet.pruning.wire import KEPT
    from edgefleet.simulation.inprocess import node_contexts
    from edgefleet.task.train import get_arrays

    FakeGrid({})
    run_config = {
        **DEFAULTS,
        "local-steps": 2,
        "batch-size": 4,
        "pruning.keep-ratios": "0.5,1.0",
        "pruning.budget": "channels",
        "pruning.criterion": "ordered-dropout",
        "pruning.reconstruction": "elementwise",
    }
    ctx = node_contexts(run_config, 4)[0 + 1]  # partition 0: keep ratio 0.5
    from edgefleet.client.device import get_device

    device = get_device(ctx.run_config, ctx.node_config)
    arrays = get_arrays(device.model)
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})})
    reply = app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    kept = {g: a.numpy() for g, a in reply.content[KEPT].items()}
    expected = prefix_kept(device.plan.channel_counts(0.5, "channels"))
    for g in expected:
        np.testing.assert_array_equal(kept[g], expected[g])
    assert reply.content["metrics"]["num-examples"] == 8
    with pytest.raises(ConfigError, match="FjORD's local steps"):
        parse_run_config({**run_config, "strategy": "fedprox"})
    with pytest.raises(ConfigError, match="compact-download"):
        parse_run_config({**run_config, "pruning.compact-download": True})
