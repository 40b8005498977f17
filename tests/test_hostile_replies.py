"""Every bad reply a device can send, through the real screening and aggregation path.

A fleet of four honest devices and one liar runs two rounds of the real
:class:`~edgefleet.loop.roundloop.RoundLoop` with Flower's FedAvg and with FedSAG (and with
EdgeFleet's own server stack, built from the run config). Each case of the table spoils the
liar's reply one way and names the reason it must be rejected with; the run must then end
with exactly the model of the same fleet without the liar (nothing of the reply reached the
model), finite, with no round dropped. Cases whose reply is usable (metrics another client
version might send) must be accepted and end with the model of an honest liar.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from edgefleet.config import parse_run_config
from edgefleet.loop.context import ScreeningRow
from edgefleet.loop.roundloop import RoundLoop, RoundResult
from edgefleet.loop.screening import Screening
from edgefleet.server.app import build_strategy, screening_for
from edgefleet.strategies.fedsag import FedSAG
from tests.fakes import FakeGrid, no_eval, rec
from tests.fakes import Rows as Keep

W0 = {
    "w": np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(3, 4),
    "b": np.array([0.5, -0.5, 1.0], dtype=np.float32),
}
HONEST = 4  # devices 0..3 on nodes 1..4; the liar is device 4 on node 5
LIAR_NODE = HONEST + 1
ROUNDS = 2
COMMON = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}


def _direction(device: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + device)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in W0.items()}


def honest_reply(msg: Message, device: int) -> Message:
    """What an honest EdgeFleet device sends: the received model moved a little."""
    got = {k: v.numpy() for k, v in msg.content["arrays"].items()}
    step = 0.01 * (1 + device % 3)
    new = {k: got[k] + step * d for k, d in _direction(device).items()}
    metrics = MetricRecord(
        {
            "num-examples": 32 * (device + 1),
            "train-loss": 1.0 / (device + 1),
            "device-id": device,
            "energy-spent": 4.0,
        }
    )
    return Message(RecordDict({"arrays": rec(new), "metrics": metrics}), reply_to=msg)


# (honest reply, round) -> what the liar sends (an Error: it declines with it)
Spoil = Callable[[Message, int], Any]


def _metrics(reply: Message, **changes: Any) -> Message:
    metrics = dict(reply.content["metrics"])
    for key, value in changes.items():
        key = key.replace("_", "-")
        if value is _DROP:
            metrics.pop(key, None)
        else:
            metrics[key] = value
    return _with(reply, metrics=MetricRecord(metrics))


def _arrays(reply: Message, fn: Callable[[np.ndarray], np.ndarray]) -> Message:
    arrays = {k: fn(v.numpy()) for k, v in reply.content["arrays"].items()}
    return _with(reply, arrays=ArrayRecord({k: Array(v) for k, v in arrays.items()}))


def _with(reply: Message, **records: Any) -> Message:
    content = {"arrays": reply.content["arrays"], "metrics": reply.content["metrics"], **records}
    out = copy.copy(reply)
    out.content = RecordDict(content)
    return out


_DROP = object()


def _forged_bytes(reply: Message, _: int) -> Message:
    """Declares the right dtype and shape, carries other data (a short float64 vector)."""
    arrays = dict(reply.content["arrays"])
    real = Array(np.zeros(2, dtype=np.float64))
    arrays["w"] = Array(dtype="float32", shape=(3, 4), stype=real.stype, data=real.data)
    return _with(reply, arrays=ArrayRecord(arrays))


def _spoof_after(reply: Message, rnd: int) -> Message:
    """Round 1 without a device id (known by its node), round 2 claiming device 1."""
    if rnd == 1:
        return _metrics(reply, device_id=_DROP)
    return _metrics(reply, device_id=1)


def _switch_ids(reply: Message, rnd: int) -> Message:
    """Round 1 as device 4, round 2 as device 7 (an id nobody holds)."""
    return _metrics(reply, device_id=4 if rnd == 1 else 7)


def _noise(reply: Message, _: int) -> Message:
    rng = np.random.default_rng(7)
    return _arrays(reply, lambda v: rng.normal(size=v.shape).astype(v.dtype))


def _zeros_heavy(reply: Message, _: int) -> Message:
    return _metrics(_arrays(reply, np.zeros_like), num_examples=10**9)


@dataclass(frozen=True)
class Case:
    name: str
    spoil: Spoil
    reason: str | None  # None: the reply must be accepted
    screening: Screening = field(default_factory=lambda: Screening(max_examples=1000.0))
    lost: tuple[int, ...] = ()  # honest devices that lose their round too (id collisions)
    rounds: tuple[int, ...] = (1, 2)  # rounds in which the liar must be rejected


CASES = [
    Case("inf num-examples", lambda r, _: _metrics(r, num_examples=float("inf")),
         "'num-examples' must be a positive finite number"),
    Case("nan num-examples", lambda r, _: _metrics(r, num_examples=float("nan")),
         "'num-examples' must be a positive finite number"),
    Case("1e308 num-examples", lambda r, _: _metrics(r, num_examples=1e308),
         "is above 9007199254740992"),
    Case("1e9 num-examples over the bound", lambda r, _: _metrics(r, num_examples=10**9),
         "above the round's bound 1000"),
    Case("1e9 num-examples with zero weights, no bound known", _zeros_heavy,
         "update norm", screening=Screening()),
    Case("zero num-examples", lambda r, _: _metrics(r, num_examples=0),
         "'num-examples' must be a positive finite number"),
    Case("negative num-examples", lambda r, _: _metrics(r, num_examples=-5),
         "'num-examples' must be a positive finite number"),
    Case("fractional num-examples", lambda r, _: _metrics(r, num_examples=2.5),
         "must be a whole number"),
    Case("list num-examples", lambda r, _: _metrics(r, num_examples=[1.0, 2.0]),
         "'num-examples' must be a positive finite number"),
    Case("missing num-examples", lambda r, _: _metrics(r, num_examples=_DROP),
         "'num-examples' must be a positive finite number"),
    Case("weights x1e30", lambda r, _: _arrays(r, lambda v: v * np.float32(1e30)),
         "update norm"),
    Case("weights x1e30, no bound known", lambda r, _: _arrays(r, lambda v: v * np.float32(1e30)),
         "update norm", screening=Screening()),
    Case("NaN weights", lambda r, _: _arrays(r, lambda v: np.full_like(v, np.nan)),
         "non-finite"),
    Case("inf weights", lambda r, _: _arrays(r, lambda v: np.full_like(v, np.inf)),
         "non-finite"),
    Case("random noise of the right shape", _noise, "update norm"),
    Case("float64 weights", lambda r, _: _arrays(r, lambda v: v.astype(np.float64)),
         "want float32"),
    Case("bytes that differ from the declared shape", _forged_bytes, "its data is float64[2]"),
    Case("spoofed device id from the first round", lambda r, _: _metrics(r, device_id=1),
         "claimed by nodes [2, 5] in the same round", lost=(1,)),
    Case("spoofed device id once the device is bound", _spoof_after,
         "device-id 1 is bound to node 2, still online", rounds=(2,)),
    Case("a node that changes its device id", _switch_ids,
         "node 5 speaks for device 4 in this run and now claims device-id 7", rounds=(2,)),
    Case("301-digit device id", lambda r, _: _metrics(r, device_id=1e300),
         "'device-id' must be a non-negative integer"),
    Case("NaN device id", lambda r, _: _metrics(r, device_id=float("nan")),
         "'device-id' must be a non-negative integer"),
    Case("negative energy", lambda r, _: _metrics(r, energy_spent=-1e6),
         "'energy-spent' must be a finite number"),
    Case("NaN energy", lambda r, _: _metrics(r, energy_spent=float("nan")),
         "'energy-spent' must be a finite number"),
    Case("energy above a round's cost", lambda r, _: _metrics(r, energy_spent=1e6),
         "'energy-spent' must be a finite number [0, 4]",
         screening=Screening(max_energy=4.0)),
    Case("list energy", lambda r, _: _metrics(r, energy_spent=[1.0]),
         "'energy-spent' must be a finite number"),
    Case("two MetricRecords", lambda r, _: _with(r, extra=MetricRecord({"x": 1.0})),
         "one MetricRecord"),
    Case("missing array", lambda r, _: _with(r, arrays=ArrayRecord({"w": r.content["arrays"]["w"]})),  # noqa: E501
         "missing ['b']"),
    # Usable replies: what another client version may send. Accepted; the metrics that are
    # not in every reply, or not of one kind, are left out of the average.
    Case("an extra metric key", lambda r, _: _metrics(r, extra_metric=3.0), None),
    Case("a missing metric key", lambda r, _: _metrics(r, train_loss=_DROP), None),
    Case("a list-valued metric", lambda r, _: _metrics(r, train_loss=[1.0, 2.0]), None),
    Case("no device id (a standard Flower reply)", lambda r, _: _metrics(r, device_id=_DROP), None),
    Case("records named differently", lambda r, _: _renamed(r), None),
]  # fmt: skip


def _renamed(reply: Message) -> Message:
    out = copy.copy(reply)
    out.content = RecordDict(
        {"weights": reply.content["arrays"], "train-metrics": reply.content["metrics"]}
    )
    return out


def _fleet(spoil: Spoil | None, without: tuple[int, ...] = ()) -> FakeGrid:
    handlers: dict[int, Callable[[Message], Message]] = {
        d + 1: (lambda msg, d=d: honest_reply(msg, d)) for d in range(HONEST) if d not in without
    }
    if spoil is not None:
        rounds = iter(range(1, 100))

        def liar(msg: Message) -> Message:
            out = spoil(honest_reply(msg, HONEST), next(rounds))
            return Message(out, reply_to=msg) if isinstance(out, Error) else out  # declines

        handlers[LIAR_NODE] = liar
    return FakeGrid(handlers)


STRATEGIES = {
    "fedavg": lambda: FedAvg(**COMMON),  # type: ignore[arg-type]
    "fedsag": lambda: FedSAG(server_lr=1.0, **COMMON),
    "edgefleet-fedsag": lambda: build_strategy(parse_run_config({"strategy": "fedsag"})),
}


def _run(make: str, grid: FakeGrid, screening: Screening) -> tuple[ArrayRecord, list[RoundResult]]:
    strategy = STRATEGIES[make]()
    keep = Keep()
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=[keep], screening=screening)  # type: ignore[arg-type]
    out = loop.run(rec(W0), ROUNDS)
    return out.arrays, keep.results


@pytest.mark.parametrize("make", ["fedavg", "fedsag"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_reply_is_rejected_with_its_reason(case: Case, make: str) -> None:
    arrays, results = _run(make, _fleet(case.spoil), case.screening)
    honest = [str(d) for d in range(HONEST) if d not in case.lost]
    for res in results:
        assert res.context.section(ScreeningRow).round_dropped is None, res.extra
        liar_rejected = [r for r in res.rejected if case.reason and case.reason in r["reason"]]
        if case.reason is None:
            assert res.rejected == [], res.rejected
            assert len(res.participants) == HONEST + 1
        elif res.round in case.rounds:
            assert len(liar_rejected) == 1 + len(case.lost), (res.round, res.rejected)
            assert res.participants == honest, res.participants
    for value in arrays.values():
        assert np.isfinite(value.numpy()).all()
    # Nothing of a rejected reply reached the model: it equals the run without the liar
    # (with an honest liar, when the reply was usable).
    if case.reason is None:
        expected, _ = _run(make, _fleet(lambda r, _: r), case.screening)
    elif case.rounds == (1, 2):
        expected, _ = _run(make, _fleet(None, case.lost), case.screening)
    else:  # the liar was honest in round 1
        return
    for key, value in expected.items():
        np.testing.assert_array_equal(arrays[key].numpy(), value.numpy(), err_msg=key)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.reason and c.rounds == (1, 2)], ids=lambda c: c.name
)
def test_edgefleet_stack_rejects_the_same(case: Case) -> None:
    """EdgeFleet's own server stack (reconstruction and FedSAG, from the run config)."""
    _, results = _run("edgefleet-fedsag", _fleet(case.spoil), case.screening)
    for res in results:
        assert res.context.section(ScreeningRow).round_dropped is None
        assert any(case.reason and case.reason in r["reason"] for r in res.rejected), res.rejected


def test_screening_from_the_run_config() -> None:
    cfg = parse_run_config({"local-steps": 7, "batch-size": 16, "energy.train-slots": 2})
    s = screening_for(cfg)
    assert (s.max_examples, s.max_energy, s.device_binding) == (112.0, 3.0, "reconnect")
    off = screening_for(parse_run_config({"screening.norm-factor": 0.0}))
    assert off.norm_factor == 0
    explicit = screening_for(parse_run_config({"screening.max-examples": 5000}))
    assert explicit.max_examples == 5000


def test_norm_bound_off_lets_a_scaled_reply_through_and_rollback_saves_the_model() -> None:
    """With the bound off, a x1e30 reply passes screening: the aggregate is finite but
    absurd. The switch is there to measure with, and says what it costs."""
    scaled = next(c for c in CASES if c.name == "weights x1e30")
    _, results = _run("fedavg", _fleet(scaled.spoil), Screening(norm_factor=0))
    assert results[0].rejected == []
    assert len(results[0].participants) == HONEST + 1


def _converged_fleet() -> FakeGrid:
    """Late in a run: three devices barely move, one whose data the others lack still does
    (its update 50 x the median, 0.05 of the model's norm)."""

    def moved(msg: Message, device: int, step: float) -> Message:
        reply = honest_reply(msg, device)
        got = {k: v.numpy() for k, v in msg.content["arrays"].items()}
        new = {k: got[k] + step * d for k, d in _direction(device).items()}
        return _with(reply, arrays=rec(new))

    handlers = {d + 1: (lambda m, d=d: moved(m, d, 0.001)) for d in range(3)}
    handlers[4] = lambda m: moved(m, 3, 0.05)
    return FakeGrid(handlers)


@pytest.mark.parametrize(("floor", "dropped"), [(0.5, []), (0.0, ["3"])])
def test_a_converged_fleet_keeps_the_device_that_still_moves(floor: float, dropped: list) -> None:
    """The median update shrinks as a model converges; the floor (a share of the model's
    norm) keeps an honest device whose update is large only against that median. Without
    the floor the ratio alone drops it."""
    _, results = _run("fedavg", _converged_fleet(), Screening(norm_floor=floor))
    for res in results:
        assert [r["device"] for r in res.rejected] == dropped
        if dropped:
            assert res.rejected[0]["reason"].endswith("(bound 10 x)")
    # With the floor, a reply above both bounds says so.
    scaled = next(c for c in CASES if c.name == "weights x1e30")
    _, results = _run("fedavg", _fleet(scaled.spoil), Screening())
    assert "x the model's norm)" in results[0].rejected[0]["reason"]


def test_norm_floor_from_the_run_config_and_its_errors() -> None:
    assert screening_for(parse_run_config({})).norm_floor == 0.5
    assert screening_for(parse_run_config({"screening.norm-floor": 0})).norm_floor == 0
    with pytest.raises(ValueError, match="screening.norm-floor.*must be >= 0"):
        parse_run_config({"screening.norm-floor": -0.1})
    with pytest.raises(ValueError, match="norm_floor"):
        Screening(norm_floor=float("nan"))


def test_one_or_two_replies_are_not_measured_until_three_norms_are_known() -> None:
    """Round 1 with two replies has no robust median: both are taken. From then on the
    norms accepted in recent rounds are the reference, and a x1e30 reply is rejected."""
    state = {"round": 0}

    def liar(msg: Message) -> Message:
        state["round"] += 1
        reply = honest_reply(msg, 1)
        if state["round"] == 3:
            return _arrays(reply, lambda v: v * np.float32(1e30))
        return reply

    grid = FakeGrid({1: lambda m: honest_reply(m, 0), 2: liar})
    keep = Keep()
    loop = RoundLoop(FedAvg(**COMMON), grid, evaluate_fn=no_eval, callbacks=[keep])  # type: ignore[arg-type]
    loop.run(rec(W0), 3)
    first, second, third = keep.results
    assert first.rejected == [] and first.context.section(ScreeningRow).update_norm_median is None
    assert (
        second.rejected == []
        and second.context.section(ScreeningRow).update_norm_median is not None
    )
    assert [r["device"] for r in third.rejected] == ["1"]
    assert "update norm" in third.rejected[0]["reason"]
    # Each round's norms are on its own context (the loop keeps none between rounds).
    assert sorted(first.context.update_norms) == ["0", "1"]
    assert all(0 < n < 1e6 for n in first.context.update_norms.values())
    assert first.context.update_norms is not second.context.update_norms
    assert third.context.update_norms["0"] < 1e6


def test_a_reconnected_device_takes_its_id_to_the_new_node_once_the_old_is_gone() -> None:
    handlers = {1: lambda m: honest_reply(m, 0), 2: lambda m: honest_reply(m, 1),
                3: lambda m: honest_reply(m, 2)}  # fmt: skip
    grid = FakeGrid(dict(handlers))  # type: ignore[arg-type]
    keep = Keep()
    loop = RoundLoop(FedAvg(**COMMON), grid, evaluate_fn=no_eval, callbacks=[keep])  # type: ignore[arg-type]
    loop.run(rec(W0), 1)
    # Device 2 restarts: node 3 goes away, node 9 comes with the same device id.
    del grid.handlers[3]
    grid.handlers[9] = lambda m: honest_reply(m, 2)
    loop.run(rec(W0), 2, first_round=2)
    assert keep.results[-1].participants == ["0", "1", "2"]
    assert loop.registry.node_of("2") == 9 and 3 in loop.registry.retired
    # Strict binding (SuperNode authentication: a reconnecting node keeps its node id).
    strict = RoundLoop(FedAvg(**COMMON), FakeGrid(dict(handlers)), evaluate_fn=no_eval,  # type: ignore[arg-type]
                       callbacks=[keep], screening=Screening(device_binding="strict"))  # fmt: skip
    strict.run(rec(W0), 1)
    strict.grid._grid = grid  # noqa: SLF001 - the same fleet after the reconnect
    strict.run(rec(W0), 2, first_round=2)
    assert keep.results[-1].participants == ["0", "1"]
    assert "device-id 2 is bound to node 3" in keep.results[-1].rejected[0]["reason"]


def test_bindings_survive_a_restart_of_the_loop() -> None:
    grid = _fleet(None)
    first = RoundLoop(FedAvg(**COMMON), grid, evaluate_fn=no_eval)  # type: ignore[arg-type]
    first.run(rec(W0), 1)
    again = RoundLoop(FedAvg(**COMMON), _fleet(lambda r, _: _metrics(r, device_id=1)),  # type: ignore[arg-type]
                      evaluate_fn=no_eval, callbacks=[keep := Keep()])  # fmt: skip
    again.load_state_dict(first.state_dict())
    again.run(rec(W0), 2, first_round=2)
    (res,) = keep.results
    assert res.participants == ["0", "1", "2", "3"]
    assert "bound to node 2" in res.rejected[0]["reason"]


# -- what a hostile reply costs ---------------------------------------------------------------
#
# Every byte a reply or a status answer holds could reach a reason, a log line, a metrics row,
# fleet.json or the checkpoint. The cases (#44): each must cost a bounded row, log and
# state, whatever its size. The bounds here are loose (a few times what an honest round of
# this fleet costs) and absolute: the same for a value of 8 MB as for one of 8 KB.

ROW_BYTES = 6_000  # one metrics.jsonl row
FLEET_BYTES = 12_000  # fleet.json
LOG_BYTES = 12_000  # the run's log, both rounds
STATE_BYTES = 6_000  # the loop's checkpoint state (the device registry)

MANY_FLOATS = [0.5] * 1_000_000  # 8 MB as float64: the num-examples


def _with_many_arrays(reply: Message, _: int) -> Message:
    arrays = dict(reply.content["arrays"])
    one = Array(np.zeros(1, dtype=np.float32))
    arrays.update({f"name-{i:05d}-" + "x" * 180: one for i in range(20_000)})
    return _with(reply, arrays=ArrayRecord(arrays))


def _with_many_metric_records(reply: Message, _: int) -> Message:
    extra = MetricRecord({"x": 1.0})
    return _with(reply, **{f"metrics-{i:05d}-" + "y" * 90: extra for i in range(20_000)})


_MANY_KEYS = {f"extra-metric-{i:06d}-" + "z" * 200: 1.0 for i in range(100_000)}


def _with_many_metric_keys(reply: Message, _: int) -> Message:
    return _with(reply, metrics=MetricRecord({**dict(reply.content["metrics"]), **_MANY_KEYS}))


def _declines_at_length(reply: Message, _: int) -> Error:
    return Error(code=0, reason="battery low\n" + "w" * 2_000_000)


HUGE_CASES: list[tuple[str, Spoil]] = [
    ("num-examples an 8 MB list of floats", lambda r, _: _metrics(r, num_examples=MANY_FLOATS)),
    ("device-id an 8 MB list of floats", lambda r, _: _metrics(r, device_id=MANY_FLOATS)),
    ("energy-spent an 8 MB list", lambda r, _: _metrics(r, energy_spent=MANY_FLOATS)),
    ("20,000 array names", _with_many_arrays),
    ("20,000 MetricRecords", _with_many_metric_records),
    ("100,000 extra metric keys", _with_many_metric_keys),
    ("a 2 MB decline reason", _declines_at_length),
]


@dataclass
class Costs:
    rows: list[int]  # bytes of each metrics.jsonl row
    fleet: int  # bytes of fleet.json after the run
    log: int  # bytes the run logged
    state: int  # bytes of the loop's checkpoint state
    results: list[RoundResult] = field(repr=False)

    def assert_bounded(self) -> None:
        assert max(self.rows) < ROW_BYTES, self.rows
        assert self.fleet < FLEET_BYTES, self.fleet
        assert self.log < LOG_BYTES, self.log
        assert self.state < STATE_BYTES, self.state


def run_costs(
    grid: FakeGrid, tmp_path: Any, caplog: pytest.LogCaptureFixture, strategy: Any = None
) -> Costs:
    """Two rounds of the real loop over ``grid`` with the ServerApp's own writers of
    metrics.jsonl and fleet.json; what the run wrote, logged and would checkpoint."""
    import json
    import logging

    from edgefleet.server.fleet import FILENAME, FleetWriter
    from edgefleet.server.results import MetricsWriter

    strategy = strategy or FedAvg(**COMMON)  # type: ignore[arg-type]
    keep = Keep()
    callbacks = [*getattr(strategy, "round_callbacks", list)(), MetricsWriter(tmp_path),
                 FleetWriter(tmp_path), keep]  # fmt: skip
    loop = RoundLoop(strategy, grid, evaluate_fn=no_eval, callbacks=callbacks,
                     screening=Screening(max_examples=1000.0))  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        loop.run(rec(W0), ROUNDS)
    logged = sum(len(r.getMessage()) for r in caplog.records)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return Costs(
        rows=[len(line) for line in lines],
        fleet=len((tmp_path / FILENAME).read_text()),
        log=logged,
        state=len(json.dumps(loop.state_dict())),
        results=keep.results,
    )


@pytest.mark.parametrize(("name", "spoil"), HUGE_CASES, ids=[c[0] for c in HUGE_CASES])
def test_a_huge_reply_costs_a_bounded_row_log_and_state(
    name: str, spoil: Spoil, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Honest in round 1 (so its device is bound, and keeps its rejections), hostile after.
    costs = run_costs(_fleet(lambda r, rnd: spoil(r, rnd) if rnd > 1 else r), tmp_path, caplog)
    costs.assert_bounded()
    first, second = costs.results
    assert first.participants == [str(d) for d in range(HONEST + 1)], first.participants
    assert second.participants == [str(d) for d in range(HONEST)], second.participants
    assert second.context.section(ScreeningRow).round_dropped is None
    assert len(second.rejected) + len(second.declined) == 1


def _status_fleet(status: dict[str, Any]) -> FakeGrid:
    """Four honest devices that answer status queries and train; a fifth whose status
    answer is ``status`` (it trains honestly)."""

    def node(device: int, answer: dict[str, Any]) -> Callable[[Message], Message]:
        def handle(msg: Message) -> Message:
            if msg.metadata.message_type == MessageType.QUERY:
                record = MetricRecord(answer)  # type: ignore[arg-type]
                return Message(RecordDict({"status": record}), reply_to=msg)
            return honest_reply(msg, device)

        return handle

    handlers = {d + 1: node(d, {"device-id": d, "feasible": 1, "labels": [d % 3]})
                for d in range(HONEST)}  # fmt: skip
    handlers[LIAR_NODE] = node(HONEST, status)
    return FakeGrid(handlers)  # type: ignore[arg-type]


STATUS_CASES: list[tuple[str, dict[str, Any]]] = [
    ("200,000 labels", {"device-id": HONEST, "feasible": 1, "labels": list(range(200_000))}),
    ("labels of huge class numbers",
     {"device-id": HONEST, "feasible": 1, "labels": [10**18 + i for i in range(1000)]}),
    ("device-id an 8 MB list", {"device-id": MANY_FLOATS, "feasible": 1}),
    ("feasible an 8 MB list", {"device-id": HONEST, "feasible": MANY_FLOATS}),
    ("battery-level an 8 MB list", {"device-id": HONEST, "battery-level": MANY_FLOATS}),
    ("num-partitions a long list", {"device-id": HONEST, "num-partitions": list(range(10**6))}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "status"), STATUS_CASES, ids=[c[0] for c in STATUS_CASES])
def test_a_huge_status_answer_costs_a_bounded_row_log_and_state(
    name: str, status: dict[str, Any], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from edgefleet.strategies.warmstart_initializer import WarmStartInitializer

    # The sessions wrapper asks for the devices' labels (its rows' session accuracy).
    strategy = WarmStartInitializer(FedAvg(**COMMON), store=tmp_path / "store", initial=rec(W0))  # type: ignore[arg-type]
    costs = run_costs(_status_fleet(status), tmp_path, caplog, strategy)
    costs.assert_bounded()
    for res in costs.results:  # the honest devices still train
        assert set(map(str, range(HONEST))) <= set(res.participants), res.participants


def test_a_list_metric_the_reconstruction_reads_is_logged_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CA-HFP's reconstruction reads each accepted reply's ``kept-fraction``. A list is kept
    by the metrics screening when every reply of the round has one of the same length (here
    the round's only reply), and the reconstruction logged it whole."""
    import logging

    def only(msg: Message) -> Message:
        return _metrics(honest_reply(msg, 0), kept_fraction=MANY_FLOATS)

    with caplog.at_level(logging.INFO, logger="flwr"):
        _, results = _run("edgefleet-fedsag", FakeGrid({1: only}), Screening(max_examples=1000.0))
    for res in results:
        assert res.context.section(ScreeningRow).round_dropped is None
        assert res.participants == ["0"]
    assert sum(len(r.getMessage()) for r in caplog.records) < LOG_BYTES
