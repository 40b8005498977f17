"""The seeds' exact forms against values computed by hand in NumPy on tiny cases: FedSAG's
1/|P_t| correction with the mean over stored memories, CA-HFP's signed g*w + h*w^2 with a
Hutchinson Hessian diagonal, the data-free stopping rule's squared norm without the reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from torch import nn

from edgefleet.algorithms.stopping import PlateauCounter
from edgefleet.config import ConfigError, parse_run_config
from edgefleet.loop.base import find_wrapper
from edgefleet.loop.context import FleetFacts
from edgefleet.pruning.importance import weight_scores
from edgefleet.server.app import build_strategy
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.stopping import TaskVectorStopping
from tests.fakes import FakeGrid, by_hand, rec

KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}

# Three devices with fixed 2-d deltas; a fourth is registered and never uploads.
DELTAS = {1: np.array([1.0, -2.0]), 2: np.array([3.0, 0.5]), 3: np.array([-1.0, 4.0])}
PLAN = {1: [1, 2], 2: [2, 3], 3: [1, 3]}


def _seed_fedsag_by_numpy() -> np.ndarray:
    """The seed's FedSAG, written out: v_t = (1/|stored|) sum_{k stored} m_k
    + (1/|P_t|) sum_{k in P_t} (delta_k - m_k); then m_k <- delta_k for k in P_t."""
    memory: dict[int, np.ndarray] = {}
    theta = np.zeros(2)
    for rnd in (1, 2, 3):
        part = PLAN[rnd]
        mean = np.mean(list(memory.values()), axis=0) if memory else np.zeros(2)
        corr = sum(DELTAS[k] - memory.get(k, np.zeros(2)) for k in part) / len(part)
        theta = theta + mean + corr
        for k in part:
            memory[k] = DELTAS[k]
    return theta


def _reply(node: int, msg: Message) -> Message:
    w = msg.content["arrays"]["w"].numpy() + DELTAS[node]
    metrics = MetricRecord({"num-examples": 1, "device-id": node})
    return Message(RecordDict({"arrays": rec(w=w), "metrics": metrics}), reply_to=msg)


def _run_fedsag(strategy: FedSAG, cap: int | None) -> np.ndarray:
    class Planned(FakeGrid):
        rnd = 1

        def get_node_ids(self) -> list[int]:
            return PLAN[self.rnd]

    grid = Planned({n: (lambda m, n=n: _reply(n, m)) for n in DELTAS})  # type: ignore[misc]
    strategy.register_devices(["1", "2", "3", "9"])
    w = rec(w=np.zeros(2))
    for rnd in (1, 2, 3):
        grid.rnd = rnd
        with by_hand(rnd) as ctx:
            ctx.fleet = FleetFacts(participant_cap=cap)  # an energy-age selection's M
            msgs = list(strategy.configure_train(rnd, w, ConfigRecord(), grid))  # type: ignore[arg-type]
            w, _ = strategy.aggregate_train(rnd, grid.send_and_receive(msgs))  # type: ignore[assignment]
    return w["w"].numpy()  # type: ignore[index]


@pytest.mark.parametrize("cap", [None, 4])
def test_fedsag_seed_form_matches_numpy(cap: int | None) -> None:
    """``saga.correction = "participants"`` + ``saga.memory-mean = "stored"`` is the seed's
    form, also under a selection cap M = 4 > |P_t| = 2 (EdgeFleet's default would weigh the
    corrections 1/4 there) and with a registered device that never uploads (not in the mean)."""
    cfg = parse_run_config(
        {"strategy": "fedsag", "saga.correction": "participants", "saga.memory-mean": "stored"}
    )
    strategy = build_strategy(cfg)
    inner = strategy
    while not isinstance(inner, FedSAG):
        inner = inner.inner  # type: ignore[attr-defined]
    got = _run_fedsag(inner, cap)
    expected = _seed_fedsag_by_numpy()
    # By hand: r1 v = ([1,-2] + [3,.5])/2 = [2,-.75]; r2 mean [2,-.75] + ([0,0] + [-1,4])/2
    # = [1.5,1.25]; r3 mean of three [1,.8333] + ([0,0] + [0,0])/2 -> theta = [4.5, 1.3333].
    np.testing.assert_allclose(expected, [4.5, -0.75 + 1.25 + 2.5 / 3], rtol=1e-12)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # EdgeFleet's default (1/max(|P|, M), the mean over all K = 4) differs from it under the cap
    default = _run_fedsag(FedSAG(**KW), 4)
    assert not np.allclose(default, expected)


class _Gated(nn.Module):
    """logits = [x . w, 0]: with samples whose inputs have disjoint supports, the Hessian of
    the mean cross-entropy in w is diagonal, so Hutchinson's z * (H z) is exact for every
    Rademacher probe (z_i^2 = 1) and the score can be checked against a closed form."""

    def __init__(self, w: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x @ self.w
        return torch.stack([s, torch.zeros_like(s)], dim=-1)


def test_ca_hfp_signed_score_with_hutchinson_matches_numpy() -> None:
    w = np.array([0.7, -1.3])
    x = np.array([[2.0, 0.0], [0.0, -1.5]])
    y = np.array([0, 1])
    model = _Gated(list(w))
    scores = weight_scores(
        model,
        [(torch.tensor(x), torch.tensor(y))],
        "curvature",
        "hutchinson",
        seed=3,
        hutchinson_samples=5,
        score="signed",
    )
    # CE of logits [s, 0] with label y: d/ds = sigmoid(s) - [y == 0], d2/ds2 = p (1 - p).
    s = x @ w
    p = 1 / (1 + np.exp(-s))
    dl = p - (y == 0)
    g = (dl[:, None] * x).mean(0)
    h = ((p * (1 - p))[:, None] * x**2).mean(0)
    expected = g * w + h * w**2
    np.testing.assert_allclose(scores["w"].numpy(), expected, rtol=1e-10)
    # The Taylor form on the same g and h, for contrast: the two rank these weights apart.
    taylor = weight_scores(
        model, [(torch.tensor(x), torch.tensor(y))], "curvature", "hutchinson", seed=3,
        hutchinson_samples=5,
    )  # fmt: skip
    np.testing.assert_allclose(taylor["w"].numpy(), np.abs(g * w - 0.5 * h * w**2), rtol=1e-10)
    assert not np.allclose(expected, np.abs(g * w - 0.5 * h * w**2))


def _fire_by_numpy(norms: list[float], tau: float, patience: int, seed: bool) -> int | None:
    """The seed's rule (squared norm, count every slow round) or the reference's (plain
    norm, count slow rounds in a row), written out; the round it fires in."""
    d = [n**2 for n in norms] if seed else list(norms)
    count = 0
    for r in range(1, len(d)):
        slow = (d[r] - d[r - 1]) / d[r - 1] < tau
        count = count + 1 if slow else (count if seed else 0)
        if count >= patience:
            return r + 1
    return None


def _fire(norms: list[float], tau: float, patience: int, seed: bool) -> int | None:
    rule = PlateauCounter(tau=tau, patience=patience, reset_on_growth=not seed)
    for r, n in enumerate(norms, start=1):
        if rule.update(n**2 if seed else n):
            return r
    return None


@pytest.mark.parametrize(
    ("norms", "seed_fires", "reference_fires"),
    [
        # slow, growth, slow, slow: the seed counts 3 slow rounds, the reference 2 in a row
        ([1.0, 1.001, 1.3, 1.301, 1.302], 5, None),
        # plain-norm growth ~0.0027 < tau, squared ~0.0054 >= tau: only the reference counts
        ([1.0, 1.0027, 1.0054, 1.0081], None, 4),
    ],
)
def test_stopping_seed_form_squared_norm_and_no_reset(
    norms: list[float], seed_fires: int | None, reference_fires: int | None
) -> None:
    tau, patience = 0.005, 3
    assert _fire_by_numpy(norms, tau, patience, seed=True) == seed_fires
    assert _fire_by_numpy(norms, tau, patience, seed=False) == reference_fires
    assert _fire(norms, tau, patience, seed=True) == seed_fires
    assert _fire(norms, tau, patience, seed=False) == reference_fires


def test_stopping_seed_form_is_selected_by_the_run_config() -> None:
    def stopper(form: str) -> TaskVectorStopping:
        from edgefleet.server.app import CentralEvaluation

        cfg = parse_run_config({"stopping.mode": "data-free", "stopping.form": form})
        central = CentralEvaluation(rec(w=np.zeros(1)), ["w"], lambda *a: {}, lambda a: {})
        found = find_wrapper(build_strategy(cfg, central), TaskVectorStopping)
        assert found is not None
        return found

    seed = stopper("seed")
    assert seed.squared and not seed.rule.reset_on_growth and seed.form == "seed"
    ref = stopper("reference")
    assert not ref.squared and ref.rule.reset_on_growth
    with pytest.raises(ConfigError, match="must be one of reference, seed"):
        parse_run_config({"stopping.form": "paper"})
