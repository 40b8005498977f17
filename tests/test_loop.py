"""The round loop with FedAvg/FedProx against hand-computed NumPy expectations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedProx

from edgefleet.config import parse_run_config
from edgefleet.loop.roundloop import LoopOutcome, RoundCallback, RoundLoop, RoundResult
from edgefleet.loop.screening import RecordKeys, check_train_reply
from edgefleet.server.results import MetricsWriter, write_summary
from tests.fakes import FakeGrid, no_eval, rec, train_reply

W0 = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32), "b": np.zeros(2, np.float32)}


def _reply(msg: Message, arrays: dict[str, np.ndarray], n: int, device: int) -> Message:
    return train_reply(msg, rec(arrays), n, **{"train-loss": 1.0, "device-id": device,
                                               "energy-spent": 2.0})  # fmt: skip


def _adds(delta: float, n: int, device: int):
    """A client that adds ``delta`` to every received weight and reports ``n`` examples."""

    def handle(msg: Message) -> Message:
        got = msg.content["arrays"].to_numpy_ndarrays()
        new = {k: v + delta for k, v in zip(W0, got, strict=True)}
        return _reply(msg, new, n, device)

    return handle


def _strategy(kind=FedAvg, **kw):
    return kind(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1, **kw)


def test_fedavg_weighted_mean_by_hand() -> None:
    grid = FakeGrid({1: _adds(1.0, 10, 0), 2: _adds(-2.0, 30, 1), 3: _adds(4.0, 60, 2)})
    loop = RoundLoop(_strategy(), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    out = loop.run(rec(W0), num_rounds=2, train_config=ConfigRecord())
    # Each round moves every weight by the example-weighted mean delta.
    step = (10 * 1.0 + 30 * -2.0 + 60 * 4.0) / 100
    got = out.arrays.to_numpy_ndarrays()
    np.testing.assert_allclose(got[0], W0["w"] + 2 * step, rtol=1e-6)
    np.testing.assert_allclose(got[1], W0["b"] + 2 * step, rtol=1e-6)
    assert out == LoopOutcome(out.arrays, 2, None, "budget", no_eval(2, out.arrays))


def test_fedprox_sends_mu_and_aggregates_like_fedavg() -> None:
    grid = FakeGrid({1: _adds(1.0, 1, 0), 2: _adds(3.0, 1, 1)})
    loop = RoundLoop(_strategy(FedProx, proximal_mu=0.25), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    out = loop.run(rec(W0), 1)
    assert all(m.content["config"]["proximal-mu"] == 0.25 for m in grid.sent)
    np.testing.assert_allclose(out.arrays.to_numpy_ndarrays()[0], W0["w"] + 2.0)


def test_bad_and_declining_replies_are_dropped_not_fatal() -> None:
    def nan_reply(msg: Message) -> Message:
        return _reply(msg, {"w": np.full((2, 2), np.nan, np.float32), "b": W0["b"]}, 5, 7)

    def wrong_shape(msg: Message) -> Message:
        return _reply(msg, {"w": np.zeros((3, 2), np.float32), "b": W0["b"]}, 5, 8)

    def missing_key(msg: Message) -> Message:
        return _reply(msg, {"w": W0["w"]}, 5, 9)

    def extra_record(msg: Message) -> Message:
        reply = _reply(msg, dict(W0), 5, 10)
        reply.content["other"] = MetricRecord({"x": 1.0})
        return reply

    def declines(msg: Message) -> Message:
        return Message(Error(10, "battery empty"), reply_to=msg)

    handlers = {1: _adds(1.0, 10, 0), 2: nan_reply, 3: wrong_shape, 4: missing_key}
    handlers.update({5: extra_record, 6: declines, 7: lambda m: None})
    grid = FakeGrid(handlers)
    seen: list[RoundResult] = []

    class Keep(RoundCallback):
        def after_round(self, result: RoundResult) -> str | None:
            seen.append(result)
            return None

    loop = RoundLoop(_strategy(), grid, evaluate_fn=no_eval, callbacks=[Keep()])  # type: ignore[arg-type]
    out = loop.run(rec(W0), 1)
    np.testing.assert_allclose(out.arrays.to_numpy_ndarrays()[0], W0["w"] + 1.0)
    (res,) = seen
    assert res.participants == ["0"]
    assert res.declined == ["node-6"]
    reasons = {r["device"]: r["reason"] for r in res.rejected}
    assert set(reasons) == {"7", "8", "9", "10"}
    assert "non-finite" in reasons["7"]
    assert "float32[3, 2]" in reasons["8"]
    assert "missing ['b']" in reasons["9"]
    assert "one ArrayRecord" in reasons["10"]
    assert res.energy_spent == 2.0
    assert res.bytes_down == 7 * rec(W0).count_bytes()
    assert res.bytes_up == rec(W0).count_bytes()


def test_no_participant_keeps_model() -> None:
    grid = FakeGrid({1: lambda m: Message(Error(10, "no"), reply_to=m)})
    loop = RoundLoop(_strategy(), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    out = loop.run(rec(W0), 2)
    np.testing.assert_array_equal(out.arrays.to_numpy_ndarrays()[0], W0["w"])


def test_callback_stop_and_result_files(tmp_path: Path) -> None:
    class StopAt2(RoundCallback):
        def after_round(self, result: RoundResult) -> str | None:
            return "enough" if result.round == 2 else None

    writer = MetricsWriter(tmp_path)
    grid = FakeGrid({1: _adds(1.0, 10, 3)})
    loop = RoundLoop(_strategy(), grid, evaluate_fn=no_eval, callbacks=[writer, StopAt2()])  # type: ignore[arg-type]
    out = loop.run(rec(W0), 5)
    assert (out.rounds_run, out.stop_round, out.stop_reason) == (2, 2, "enough")
    summary = write_summary(tmp_path, parse_run_config({}), out, writer.rows, 1.5)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    types = {
        "round": int,
        "session": int,
        "test_accuracy": float,
        "test_loss": float,
        "participants": list,
        "declined": list,
        "bytes_up": int,
        "bytes_down": int,
        "energy_spent": float,
        "wall_s": float,
    }
    for row in rows:
        for key, typ in types.items():
            assert isinstance(row[key], typ), key
    assert rows[0]["participants"] == ["3"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["stop_round"] == 2 and on_disk["stop_reason"] == "enough"
    assert on_disk["rounds_run"] == 2
    assert on_disk["final_accuracy"] == pytest.approx(0.5)
    assert on_disk["total_bytes_up"] == sum(r["bytes_up"] for r in rows)
    assert on_disk["config"]["dataset"] == "mnist-5k"
    for key in ("best_accuracy", "total_bytes_down", "wall_s"):
        assert key in on_disk


def test_check_train_reply_accepts_good_reply() -> None:
    grid = FakeGrid({1: _adds(0.0, 3, 0)})
    ins = Message(RecordDict({"arrays": rec(W0), "config": ConfigRecord()}), 1, "train")
    assert check_train_reply(grid.handlers[1](ins), rec(W0), RecordKeys()) is None  # type: ignore[arg-type]


def test_reply_with_malformed_device_id_is_rejected_and_one_without_is_not() -> None:
    grid = FakeGrid({1: _adds(0.0, 3, 0)})
    ins = Message(RecordDict({"arrays": rec(W0), "config": ConfigRecord()}), 1, "train")
    for bad in (float("nan"), 1.5, -3, 10**30, [1, 2]):
        reply = grid.handlers[1](ins)  # type: ignore[arg-type]
        reply.content.metric_records["metrics"]["device-id"] = bad  # type: ignore[assignment]
        reason = check_train_reply(reply, rec(W0), RecordKeys())
        assert reason is not None and "'device-id'" in reason, bad
    # A standard Flower reply has no device id: valid, keyed by its node.
    reply = grid.handlers[1](ins)  # type: ignore[arg-type]
    del reply.content.metric_records["metrics"]["device-id"]
    assert check_train_reply(reply, rec(W0), RecordKeys()) is None


def test_an_unreachable_device_is_its_own_outcome_not_a_decline(tmp_path: Path) -> None:
    """Flower's SuperLink answers a message to a killed SuperNode with NODE_UNAVAILABLE: the
    device is gone, not declining (the battery decline is the device's own Error)."""
    from flwr.common.constant import ErrorCode

    from edgefleet.dashboard.metrics import render_data
    from edgefleet.server.results import MetricsRow
    from edgefleet.simulation.story import _energy_helped

    def gone(msg: Message) -> Message:
        reason = "Error: Node Unavailable — The destination node failed to report a heartbeat"
        return Message(Error(ErrorCode.NODE_UNAVAILABLE, reason), reply_to=msg)

    def no_energy(msg: Message) -> Message:
        return Message(Error(12, "battery 1.00 < round cost 4"), reply_to=msg)

    grid = FakeGrid({1: _adds(1.0, 2, 1), 2: gone, 3: no_energy})
    writer = MetricsWriter(tmp_path)
    loop = RoundLoop(_strategy(), grid, evaluate_fn=no_eval, callbacks=[writer])
    loop.run(rec(W0), 1)
    row = writer.rows[0]
    assert row["unreachable"] == ["node-2"] and row["declined"] == ["node-3"]
    assert row["participants"] == ["1"]
    text = render_data({"devices": []}, writer.rows).decode()
    assert "edgefleet_replies_unreachable_total 1.0" in text
    assert "edgefleet_replies_declined_total 1.0" in text
    told = _energy_helped({"selection.mode": "energy-age"}, [MetricsRow.parse(row)])
    assert told is not None and "1 of 3 train messages were declined" in told
    assert "1 went to devices the transport could not reach" in told
