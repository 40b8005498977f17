"""Data-free early stopping (arXiv 2601.22669) and the validation baseline."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.algorithms.stopping import PlateauCounter, ValidationPatience
from edgefleet.loop.context import StoppingRow, ValidationRow
from edgefleet.loop.roundloop import RoundResult
from edgefleet.strategies.stopping import (
    STOP_DIVERGED,
    STOP_PLATEAU,
    TaskVectorStopping,
    ValidationStopping,
    task_vector_norm,
    trainable_keys,
)
from tests.fakes import FakeGrid, rec


def _fire_round(norms: list[float], tau: float = 0.005, patience: int = 3) -> int | None:
    rule = PlateauCounter(tau=tau, patience=patience)
    for r, d in enumerate(norms, start=1):
        if rule.update(d):
            return r
    return None


def test_stops_exactly_after_patience_flat_rounds() -> None:
    # g_2..g_4 = 0.1, then g_5.. = 0: the counter reads 1, 2, 3 at rounds 5, 6, 7.
    assert _fire_round([1, 1.1, 1.21, 1.331, 1.331, 1.331, 1.331, 1.331]) == 7


def test_counter_resets_on_growth() -> None:
    # flat, flat, jump (reset), flat x3 -> fires at round 8, not 5
    assert _fire_round([1, 2, 2, 2, 4, 4, 4, 4, 4]) == 8


def test_growth_just_below_and_at_tau() -> None:
    below = [1.0]
    for _ in range(5):
        below.append(below[-1] * 1.0049)
    assert _fire_round(below, tau=0.005, patience=3) == 4
    at = [1.0, 1.5, 2.25, 3.375]  # g = 0.5 exactly: not below tau = 0.5, so no count
    assert _fire_round(at, tau=0.5, patience=1) is None


def test_never_stops_on_steady_growth() -> None:
    # d_r = r: g_r = 1/(r-1) stays above tau = 0.005 up to r = 201
    assert _fire_round([float(r) for r in range(1, 201)], patience=2) is None


def test_zero_reference_norm() -> None:
    # theta_1 == theta_0: growth from zero is infinite (reset) or none (counts)
    assert _fire_round([0.0, 0.0, 0.0], patience=2) == 3
    rule = PlateauCounter(patience=2)
    for d in (0.0, 0.0, 1.0):
        rule.update(d)
    assert rule.counter == 0 and rule.growth[-1] == math.inf


def test_squared_norm_threshold_mapping() -> None:
    rng = np.random.default_rng(0)
    norms = np.cumsum(rng.exponential(1.0, 60) * np.geomspace(1, 1e-3, 60)) + 1
    tau = 0.005
    plain = _fire_round(list(norms), tau=tau, patience=4)
    squared = _fire_round(list(norms**2), tau=(1 + tau) ** 2 - 1, patience=4)
    assert plain is not None and plain == squared


def test_state_round_trip() -> None:
    rule = PlateauCounter(patience=3)
    for d in (1.0, 1.5, 1.5):
        rule.update(d)
    copy = PlateauCounter(patience=3)
    copy.load_state_dict(rule.state_dict())
    assert copy.update(1.5) == rule.update(1.5)
    assert copy.state_dict() == rule.state_dict()


def test_task_vector_norm_by_hand_and_bn_excluded() -> None:
    theta0 = rec(w=np.zeros((2, 2)), b=np.zeros(2), **{"bn.running_mean": np.zeros(2)})
    theta = rec(w=np.full((2, 2), 1.0), b=np.array([2.0, 0.0]), **{"bn.running_mean": np.ones(2)})
    keys = trainable_keys(theta0)
    assert keys == ["w", "b"]
    assert task_vector_norm(theta, theta0, keys) == pytest.approx(math.sqrt(4 + 4))
    assert task_vector_norm(theta, theta0, keys, squared=True) == pytest.approx(8.0)


def _result(rnd: int, arrays: ArrayRecord, participants: list[str]) -> RoundResult:
    return RoundResult(rnd, 0, arrays, participants, [], [], 0, 0, 0.0, {}, {}, 0.0)


def test_diverged_and_empty_rounds() -> None:
    stop = TaskVectorStopping(FedAvg(), patience=1)
    theta0 = rec(w=np.zeros(3))
    stop.on_start(theta0, 1)
    assert stop.after_round(_result(1, rec(w=np.ones(3)), ["0"])) is None
    # Empty rounds carry no growth information: the model is unchanged, yet no count.
    for r in (2, 3, 4):
        assert stop.after_round(_result(r, rec(w=np.ones(3)), [])) is None
    assert stop.rule.counter == 0
    assert stop.after_round(_result(5, rec(w=np.ones(3)), ["0"])) == STOP_PLATEAU
    nan = rec(w=np.array([0.0, np.nan, 1.0]))
    assert stop.after_round(_result(6, nan, ["0"])) == STOP_DIVERGED


def test_each_round_logs_its_growth_beside_tau(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tuning tau needs the growth it is compared with: every measured round logs both."""
    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)
    stop = TaskVectorStopping(FedAvg(), tau=0.05, patience=3)
    stop.on_start(rec(w=np.zeros(2)), 1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        stop.after_round(_result(1, rec(w=np.array([3.0, 4.0])), ["0"]))  # norm 5
        stop.after_round(_result(2, rec(w=np.array([3.0, 4.1])), ["0"]))
    lines = [r.getMessage() for r in caplog.records if "task vector growth" in r.getMessage()]
    growth = (math.hypot(3.0, 4.1) - 5.0) / 5.0
    assert lines == [
        "Round 1: task vector growth - (tau 0.05), plateau 0/3",
        f"Round 2: task vector growth {growth:.4g} (tau 0.05), plateau 1/3",
    ]


def _shrinking_client(w0: np.ndarray):
    """Moves the model towards 2*w0 by half the remaining distance: the task vector's
    norm converges geometrically, so its growth falls below any tau."""

    def handle(msg: Message) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        new = w + 0.5 * (2 * w0 - w)
        metrics = MetricRecord({"num-examples": 1, "device-id": 0})
        content = RecordDict({"arrays": rec(w=new), "metrics": metrics})
        return Message(content, reply_to=msg)

    return handle


def test_flower_start_api_stops_early() -> None:
    w0 = np.ones(4, np.float32)
    grid = FakeGrid({1: _shrinking_client(w0)})
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    strategy = TaskVectorStopping(inner, tau=0.01, patience=3)
    result = strategy.start(grid, rec(w=w0), num_rounds=100)  # type: ignore[arg-type]
    # d_r = ||w0|| (1 - 2^-r): g_r = 2^-r / (1 - 2^-(r-1)) < 0.01 from r = 7 on -> stop at 9
    assert len(grid.sent) == 9
    np.testing.assert_allclose(result.arrays["w"].numpy(), w0 * (2 - 0.5**9), rtol=1e-6)


def test_validation_stopping_best_rule_keeps_best() -> None:
    accs = iter([0.5, 0.7, 0.6, 0.65, 0.69, 0.7])
    stop = ValidationStopping(FedAvg(), lambda arrays: next(accs), patience=3, rule="best")
    reasons = [stop.after_round(_result(r, rec(w=np.full(1, r)), ["0"])) for r in range(1, 6)]
    assert reasons == [None, None, None, None, "validation-plateau"]
    assert stop.best_round == 2 and stop.counter.best_accuracy == 0.7
    assert stop.best_arrays is not None and stop.best_arrays["w"].numpy()[0] == 2.0


def test_reference_rule_counts_rounds_without_enough_improvement_of_either_figure() -> None:
    """By hand, min_delta 0.01, patience 2: accuracy and loss each may reset the counter;
    a figure's reference (to beat by 0.01) moves only when it does."""
    figures = [
        (0.50, 1.00),  # 1: improves (first); references 0.50 and 1.00
        (0.505, 0.95),  # 2: accuracy +0.005 (too little), loss -0.05: improves; ref loss 0.95
        (0.508, 0.945),  # 3: 0.508 <= 0.51, 0.945 >= 0.94: counter 1
        (0.52, 0.946),  # 4: 0.52 > 0.50 + 0.01: resets; ref accuracy 0.52
        (0.525, 0.942),  # 5: 0.525 <= 0.53, 0.942 >= 0.95 - 0.01: counter 1
        (0.529, 0.941),  # 6: counter 2 -> fires
    ]
    rule = ValidationPatience("reference", patience=2, min_delta=0.01)
    fired = [rule.update(r, a, loss) for r, (a, loss) in enumerate(figures, start=1)]
    assert fired == [False, False, False, False, False, True]
    assert rule.best_round == 6 and rule.best_accuracy == 0.529


def test_validation_stopping_reference_rule_records_loss_and_keeps_no_best_model() -> None:
    figures = iter([{"accuracy": 0.5, "loss": 1.0}, {"accuracy": 0.5, "loss": 1.0}])
    stop = ValidationStopping(FedAvg(), lambda arrays: next(figures), patience=1)
    first = _result(1, rec(w=np.ones(1)), ["0"])
    assert stop.after_round(first) is None
    second = _result(2, rec(w=np.ones(1)), ["0"])
    assert stop.after_round(second) == "validation-plateau"
    assert second.context.section(ValidationRow).validation_loss == 1.0 and stop.best_arrays is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="l2, squared"):
        TaskVectorStopping(FedAvg(), norm="l1")
    with pytest.raises(ValueError, match="patience"):
        TaskVectorStopping(FedAvg(), patience=0)


def test_observe_mode_records_both_rules_and_never_stops() -> None:
    from edgefleet.config import parse_run_config
    from edgefleet.server.app import CentralEvaluation, build_strategy

    cfg = parse_run_config({"stopping.mode": "observe", "stopping.patience": 1})
    central = CentralEvaluation(rec(w=np.zeros(2)), ["w"], lambda r, a: {}, lambda a: 0.5)
    strategy = build_strategy(cfg, central)
    callbacks = strategy.round_callbacks()  # type: ignore[attr-defined]
    for cb in callbacks:
        cb.on_start(rec(w=np.zeros(2)), 1)
    for r in range(1, 6):
        res = _result(r, rec(w=np.ones(2)), ["0"])
        assert [cb.after_round(res) for cb in callbacks] == [None] * len(callbacks)
    assert (
        res.context.section(StoppingRow).plateau_count == 4
        and res.context.section(ValidationRow).validation_accuracy == 0.5
    )


def test_the_counter_keeps_a_bounded_growth_history() -> None:
    from edgefleet.algorithms.stopping import GROWTH_KEPT, PlateauCounter

    rule = PlateauCounter(tau=0.0, patience=10**9)
    for r in range(GROWTH_KEPT * 3):
        rule.update(1.0 + r)
    assert len(rule.growth) == GROWTH_KEPT
    assert rule.growth[-1] == pytest.approx(1 / (GROWTH_KEPT * 3 - 1))
    state = rule.state_dict()
    state["growth"] = [0.5] * (GROWTH_KEPT * 2)  # an older, longer checkpoint
    rule.load_state_dict(state)
    assert len(rule.growth) == GROWTH_KEPT
