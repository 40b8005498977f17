"""The field's baselines (MIFA, FedVARP, SCAFFOLD) against their papers' update rules, each
written out in NumPy on a tiny case, in the style of flwr's fedavgm_test.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from edgefleet.algorithms.saga import SagaError
from edgefleet.config import DEFAULTS, ConfigError, parse_run_config
from edgefleet.loop.base import find_wrapper
from edgefleet.loop.context import FleetFacts
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.server.app import build_strategy
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.scaffold import Scaffold, effective_steps, scaffold_step
from edgefleet.task.datasets import ArrayDataset
from edgefleet.task.train import train_local
from edgefleet.wire import SCAFFOLD_APPLIED, SCAFFOLD_CORRECTION
from tests.fakes import FakeGrid, by_hand, no_eval, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}
DELTAS = {1: np.array([1.0, -2.0]), 2: np.array([3.0, 0.5]), 3: np.array([-1.0, 4.0])}
PLAN = {1: [1, 2], 2: [2, 3], 3: [1, 3], 4: [2]}
N = 4  # devices 1, 2, 3 train; device 9 is registered and never does


class _Planned(FakeGrid):
    rnd = 1

    def get_node_ids(self) -> list[int]:
        return PLAN[self.rnd]


def _delta_reply(node: int, msg: Message) -> Message:
    w = msg.content["arrays"]["w"].numpy() + DELTAS[node]
    metrics = MetricRecord({"num-examples": 1 + node, "device-id": node})
    return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)


def _run(strategy: FedSAG, handler: Callable[[int, Message], Message] = _delta_reply) -> np.ndarray:
    grid = _Planned({n: (lambda m, n=n: handler(n, m)) for n in DELTAS})  # type: ignore[misc]
    strategy.register_devices(["1", "2", "3", "9"])
    w = rec(w=np.zeros(2))
    for rnd in PLAN:
        grid.rnd = rnd
        with by_hand(rnd) as ctx:
            ctx.fleet = FleetFacts(
                participant_cap=3
            )  # under an energy-age cap M = 3: no effect on either
            msgs = list(strategy.configure_train(rnd, w, ConfigRecord(), grid))  # type: ignore[arg-type]
            w, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))  # type: ignore[assignment]
    return w["w"].numpy()  # type: ignore[index]


def test_mifa_averages_every_devices_latest_update() -> None:
    """MIFA (Gu et al. 2021): G_i <- delta_i for the participants, theta += (1/N) sum G_i."""
    g = np.zeros((N, 2))  # rows: devices 1, 2, 3, 9; zero until a device first uploads
    theta = np.zeros(2)
    for part in PLAN.values():
        for k in part:
            g[k - 1] = DELTAS[k]
        theta = theta + g.mean(axis=0)
    # by hand: r1 (G1 + G2) / 4 = [1, -.375]; r2-r4 all three stored: [3, 2.5] / 4 each
    np.testing.assert_allclose(theta, [1 + 3 * 0.75, -0.375 + 3 * 0.625])
    np.testing.assert_allclose(_run(MIFA(**KW)), theta, rtol=1e-6)
    # server_lr scales the step
    np.testing.assert_allclose(_run(MIFA(server_lr=0.5, **KW)), theta / 2, rtol=1e-6)


def test_fedvarp_is_algorithm_1() -> None:
    """FedVARP (Jhunjhunwala et al. 2022): v = (1/|S|) sum_S (delta - y) + (1/N) sum_N y."""
    y = np.zeros((N, 2))
    theta = np.zeros(2)
    for part in PLAN.values():
        corr = np.mean([DELTAS[k] - y[k - 1] for k in part], axis=0)
        theta = theta + corr + y.mean(axis=0)
        for k in part:
            y[k - 1] = DELTAS[k]
    np.testing.assert_allclose(_run(FedVARP(**KW)), theta, rtol=1e-6)
    # It is neither MIFA nor the seed's FedSAG (mean over the stored memories only).
    assert not np.allclose(theta, _run(MIFA(**KW)))
    seed = FedSAG(correction="participants", mean_over="stored", **KW)
    assert not np.allclose(theta, _run(seed))


def test_mifa_and_fedvarp_refuse_to_change_their_form() -> None:
    with pytest.raises(SagaError, match="MIFA fixes estimator"):
        MIFA(estimator="saga", **KW)
    with pytest.raises(SagaError, match="FedVARP fixes correction, mean_over"):
        FedVARP(correction="channels", mean_over="stored", **KW)
    with pytest.raises(ConfigError, match="'saga.memory-mean' with strategy = 'fedvarp'"):
        parse_run_config({"strategy": "fedvarp", "saga.memory-mean": "stored"})


# --------------------------------------------------------------------------------- SCAFFOLD

# Device i's loss is f_i(y) = 1/2 ||y - a_i||^2 (gradient y - a_i): local optima far apart,
# where uncorrected local steps drift most.
OPTIMA = {1: np.array([4.0, 0.0]), 2: np.array([0.0, -2.0]), 3: np.array([-3.0, 5.0])}
K, ETA = 3, 0.2


def _local(y: np.ndarray, a: np.ndarray, correction: np.ndarray) -> np.ndarray:
    for _ in range(K):
        y = y - ETA * ((y - a) + correction)
    return y


def _scaffold_by_numpy(
    rounds: dict[int, list[int]], server_lr: float, devices: int = N
) -> np.ndarray:
    """Algorithm 1 of arXiv 1910.06378 with option II, the device keeping its own c_i."""
    x, c = np.zeros(2), np.zeros(2)
    ci = {i: np.zeros(2) for i in OPTIMA}
    for part in rounds.values():
        dy, dc = [], []
        for i in part:
            y = _local(x, OPTIMA[i], c - ci[i])
            new = ci[i] - c + (x - y) / (K * ETA)
            dy.append(y - x)
            dc.append(new - ci[i])
            ci[i] = new
        x = x + server_lr * np.mean(dy, axis=0)
        c = c + np.sum(dc, axis=0) / devices
    return x


def _scaffold_device(node: int, msg: Message) -> Message:
    """A cooperating ClientApp: adds the correction it is sent to every gradient."""
    x = msg.content["arrays"]["w"].numpy().astype(np.float64)
    corr = msg.content[SCAFFOLD_CORRECTION]["w"].numpy().astype(np.float64)
    y = _local(x, OPTIMA[node], corr)
    metrics = MetricRecord({"num-examples": 1, "device-id": node, SCAFFOLD_APPLIED: 1})
    return Message(RecordDict({"arrays": rec(w=y), "metrics": metrics}), reply_to=msg)


def _run_scaffold(strategy: Scaffold, handler: Callable[[int, Message], Message]) -> np.ndarray:
    grid = _Planned({n: (lambda m, n=n: handler(n, m)) for n in OPTIMA})  # type: ignore[misc]
    strategy.register_devices(["1", "2", "3", "9"])
    registry = DeviceRegistry()  # one for the run, binding nodes on replies as the loop does
    w = rec(w=np.zeros(2))
    for rnd in PLAN:
        grid.rnd = rnd
        with by_hand(rnd, registry):
            msgs = list(strategy.configure_train(rnd, w, ConfigRecord(), grid))  # type: ignore[arg-type]
            replies = list(grid.send_and_receive(msgs))
            for r in replies:
                registry.bind(r.metadata.src_node_id, str(r.content["metrics"]["device-id"]))
            out, _ = strategy.aggregate_train(rnd, replies)
            w = out if out is not None else w
    return w["w"].numpy()  # type: ignore[index]


def test_scaffold_on_edgefleets_round_loop() -> None:
    """``Scaffold(...).start(grid, ...)``, the way a Flower user runs it: three rounds with
    every device, the loop's screening and device binding in between."""
    every = {r: [1, 2, 3] for r in (1, 2, 3)}
    out = Scaffold(K, ETA, **KW).start(
        FakeGrid({n: (lambda m, n=n: _scaffold_device(n, m)) for n in OPTIMA}),  # type: ignore[misc]
        rec(w=np.zeros(2)),
        num_rounds=3,
        evaluate_fn=no_eval,
    )
    # N = 3 here: nobody else was ever registered
    np.testing.assert_allclose(
        out.arrays["w"].numpy(), _scaffold_by_numpy(every, 1.0, devices=3), rtol=1e-5
    )


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_scaffold_with_server_held_control_variates_is_algorithm_1(server_lr: float) -> None:
    expected = _scaffold_by_numpy(PLAN, server_lr)
    got = _run_scaffold(Scaffold(K, ETA, server_lr=server_lr, **KW), _scaffold_device)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # The correction matters here: FedAvg of uncorrected local steps lands elsewhere.
    x = np.zeros(2)
    for part in PLAN.values():
        x = x + server_lr * np.mean([_local(x, OPTIMA[i], np.zeros(2)) - x for i in part], 0)
    assert not np.allclose(expected, x, atol=1e-3)


def test_scaffold_step_by_hand() -> None:
    x, c = np.array([1.0, 1.0]), np.array([0.5, -0.5])
    ups = {"a": (np.array([0.0, 2.0]), np.array([1.0, 0.0]))}
    new_x, new_c, new_ci = scaffold_step(x, c, ups, num_devices=2, steps_lr=0.5)
    # c_a+ = [1, 0] - [.5, -.5] + ([1, 1] - [0, 2]) / .5 = [2.5, -1.5]; dc = [1.5, -1.5]
    np.testing.assert_allclose(new_ci["a"], [2.5, -1.5])
    np.testing.assert_allclose(new_c, [0.5 + 0.75, -0.5 - 0.75])
    np.testing.assert_allclose(new_x, [0.0, 2.0])


def test_effective_steps_of_heavy_ball_momentum() -> None:
    """K momentum steps along a constant direction move eta d K_eff; K_eff = K at beta 0."""
    beta, d, y, buf = 0.9, 1.0, 0.0, 0.0
    for _ in range(5):  # torch.optim.SGD's heavy ball: buf = beta buf + g; y -= eta buf
        buf = beta * buf + d
        y -= 0.1 * buf
    assert effective_steps(5, beta) == pytest.approx(-y / 0.1)
    assert effective_steps(5, 0.0) == 5.0


def test_scaffold_drops_a_reply_from_an_app_that_ignores_the_correction() -> None:
    """A Flower quickstart-style reply (no ``scaffold-applied``) is dropped with a reason;
    the cooperating devices' replies are aggregated as if it had not replied."""

    def mixed(node: int, msg: Message) -> Message:
        if node == 2:
            return _delta_reply(node, msg)
        return _scaffold_device(node, msg)

    only = {r: [i for i in p if i != 2] for r, p in PLAN.items()}
    only = {r: p for r, p in only.items() if p}
    strategy = Scaffold(K, ETA, **KW)
    got = _run_scaffold(strategy, mixed)
    np.testing.assert_allclose(got, _scaffold_by_numpy(only, 1.0), rtol=1e-5)
    assert "2" not in strategy.ci
    # every reply refused: no step at all
    assert np.all(_run_scaffold(Scaffold(K, ETA, **KW), _delta_reply) == 0)


def test_scaffold_state_round_trip() -> None:
    a = Scaffold(K, ETA, **KW)
    _run_scaffold(a, _scaffold_device)
    b = Scaffold(K, ETA, **KW)
    b.load_state_dict(a.state_dict())
    assert b.c is not None and a.c is not None
    np.testing.assert_array_equal(b.c, a.c)
    assert set(b.ci) == set(a.ci) == {"1", "2", "3"}
    for i in a.ci:
        np.testing.assert_array_equal(b.ci[i], a.ci[i])


def test_train_local_adds_the_correction_to_every_gradient() -> None:
    """EdgeFleet's client side: one plain SGD step moves by -lr (g + correction)."""
    torch.manual_seed(0)
    data = ArrayDataset(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32),
                        np.array([0, 1, 0, 1]))  # fmt: skip
    base = nn.Linear(3, 2)
    corr = {"weight": torch.full((2, 3), 0.25), "bias": torch.tensor([1.0, -1.0])}
    moved = {}
    for name, c in (("plain", None), ("corrected", corr)):
        model = nn.Linear(3, 2)
        model.load_state_dict(base.state_dict())
        train_local(model, data, steps=1, batch_size=4, lr=0.1, momentum=0.0, seed=0,
                    correction=c)  # fmt: skip
        moved[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, c in corr.items():
        torch.testing.assert_close(moved["corrected"][k] - moved["plain"][k], -0.1 * c)


def test_run_config_selects_each_baseline_and_names_the_choices() -> None:
    def inner(name: str) -> object:
        strategy = build_strategy(
            parse_run_config({"strategy": name, "selection.mode": "energy-age"})
        )
        assert find_wrapper(strategy, EnergyAgeSelection) is not None
        return strategy.inner.inner  # type: ignore[attr-defined]  # selection > reconstruction

    assert type(inner("mifa")) is MIFA
    assert type(inner("fedvarp")) is FedVARP
    scaffold = inner("scaffold")
    assert isinstance(scaffold, Scaffold)
    assert (scaffold.local_steps, scaffold.lr, scaffold.momentum) == (
        DEFAULTS["local-steps"],
        DEFAULTS["lr"],
        DEFAULTS["momentum"],
    )
    with pytest.raises(ConfigError, match="fedavg, fedprox, fedsag, mifa, fedvarp, scaffold"):
        parse_run_config({"strategy": "feddyn"})
    with pytest.raises(ConfigError, match="fits no pruned submodel"):
        parse_run_config({"strategy": "scaffold", "pruning.keep-ratio": 0.5})
    with pytest.raises(ConfigError, match="robust.rule"):
        parse_run_config({"strategy": "scaffold", "robust.rule": "median"})


def test_edgefleet_clientapp_applies_the_correction_and_says_so() -> None:
    """EdgeFleet's own ClientApp reads the correction, trains with it and replies with
    ``scaffold-applied``; a correction that does not fit its model is an error reply."""
    from edgefleet.client.app import app
    from edgefleet.client.device import get_device
    from edgefleet.simulation.inprocess import node_contexts
    from edgefleet.task.train import get_arrays

    FakeGrid({})  # sets the task identity that building messages needs
    run_config = {**DEFAULTS, "local-steps": 1, "batch-size": 4, "dataset": "mnist-5k"}
    ctx = node_contexts(run_config, 4)[1]
    arrays = get_arrays(get_device(ctx.run_config, ctx.node_config).model)
    zeros = rec({k: np.zeros_like(v.numpy()) for k, v in arrays.items()})

    def train(correction: object) -> Message:
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})})
        if correction is not None:
            content[SCAFFOLD_CORRECTION] = correction  # type: ignore[assignment]
        return app(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), ctx)

    plain, corrected = train(None), train(zeros)
    assert SCAFFOLD_APPLIED not in plain.content["metrics"]
    assert corrected.content["metrics"][SCAFFOLD_APPLIED] == 1
    for k in arrays:  # a zero correction is plain training
        np.testing.assert_array_equal(
            corrected.content["arrays"][k].numpy(), plain.content["arrays"][k].numpy()
        )
    first = next(iter(arrays))
    bad = rec({first: np.zeros(3)})
    reply = train(bad)
    assert reply.has_error() and "does not fit" in reply.error.reason
