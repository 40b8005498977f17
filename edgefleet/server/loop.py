"""The one round loop every EdgeFleet run goes through, with callbacks.

Flower's ``Strategy.start`` runs a fixed number of rounds and offers no hook between them;
stopping rules, checkpoints and metrics rows would each have to copy it. Here the loop is
written once: per round it asks the strategy for train messages, sends them with a bounded
timeout, screens the replies (a malformed one is dropped with a logged reason instead of
letting Flower's consistency check end the run), lets the strategy aggregate, evaluates the
global model centrally, and hands a :class:`RoundResult` to each callback in order. Any
callback may ask to stop (in the style of pfl-research's ``after_central_iteration``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

EvaluateFn = Callable[[int, ArrayRecord], dict[str, float]]


@dataclass
class RoundResult:
    """What happened in one round; callbacks read it, and may add to ``extra``."""

    round: int
    session: int
    arrays: ArrayRecord  # global model after the round
    participants: list[str]  # device ids whose update was aggregated
    declined: list[str]  # devices that answered with an error
    rejected: list[dict[str, str]]  # {"device": ..., "reason": ...} for dropped replies
    bytes_up: int
    bytes_down: int
    energy_spent: float
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float]  # central evaluation: test_loss, test_accuracy
    wall_s: float  # seconds since the loop started
    extra: dict[str, object] = field(default_factory=dict)


class RoundCallback:
    """Base class of round callbacks; override what you need."""

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        """Called once before the first round with the model the loop starts from."""

    def after_round(self, result: RoundResult) -> str | None:
        """Called after each round; return a stop reason to end the run, else None."""
        return None


@dataclass(frozen=True)
class LoopOutcome:
    arrays: ArrayRecord
    rounds_run: int
    stop_round: int | None  # round at which a callback stopped the run; None = budget used
    stop_reason: str  # "budget" or the callback's reason


def device_of(msg: Message, known: dict[int, str]) -> str:
    """The device id a reply speaks for; falls back to the Flower node id."""
    node = msg.metadata.src_node_id
    if not msg.has_error() and msg.has_content():
        metrics = msg.content.metric_records.get("metrics")
        device = metrics.get("device-id") if metrics is not None else None
        if isinstance(device, int | float) and np.isfinite(device):
            known[node] = str(int(device))
    return known.get(node, f"node-{node}")


def check_train_reply(msg: Message, reference: ArrayRecord) -> str | None:
    """Why a (non-error) train reply cannot be aggregated, or None if it can.

    The checks are those Flower's strategies would otherwise fail on mid-aggregation, plus
    the ones that would silently poison the model (shape, dtype, non-finite values).
    """
    content = msg.content
    if set(content.array_records) != {"arrays"} or set(content.metric_records) != {"metrics"}:
        return (
            f"expected one ArrayRecord 'arrays' and one MetricRecord 'metrics', got "
            f"{sorted(content.array_records)} and {sorted(content.metric_records)}"
        )
    return check_metrics(content.metric_records["metrics"]) or check_arrays(
        content.array_records["arrays"],
        {key: (tuple(ref.shape), ref.dtype) for key, ref in reference.items()},
    )


def check_metrics(metrics: MetricRecord) -> str | None:
    """Why a train reply's metrics are unusable (the weight and the device id), or None."""
    n = metrics.get("num-examples")
    if not isinstance(n, int | float) or not n > 0:
        return f"metric 'num-examples' must be a positive number, got {n!r}"
    device = metrics.get("device-id")
    if not isinstance(device, int | float) or not np.isfinite(device) or device != int(device):
        # FedSAG keys its memory by it; EdgeFleet's ClientApp always sends it.
        return f"metric 'device-id' must be an integer, got {device!r}"
    return None


def check_arrays(
    arrays: ArrayRecord, expected: dict[str, tuple[tuple[int, ...], str]]
) -> str | None:
    """Why ``arrays`` do not match ``expected`` (key -> (shape, dtype)) or hold non-finite
    values, or None."""
    if set(arrays) != set(expected):
        missing, extra = set(expected) - set(arrays), set(arrays) - set(expected)
        return f"array keys differ: missing {sorted(missing)}, unexpected {sorted(extra)}"
    for key, (shape, dtype) in expected.items():
        got = arrays[key]
        if tuple(got.shape) != shape or got.dtype != dtype:
            return f"array {key!r}: got {got.dtype}{list(got.shape)}, want {dtype}{list(shape)}"
        value = got.numpy()
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"array {key!r} has non-finite values"
    return None


class RoundLoop:
    """Drive ``strategy`` for up to ``num_rounds`` rounds over ``grid``."""

    def __init__(
        self,
        strategy: Strategy,
        grid: Grid,
        *,
        evaluate_fn: EvaluateFn,
        callbacks: Sequence[RoundCallback] = (),
        round_timeout: float = 600.0,
    ) -> None:
        self.strategy = strategy
        self.grid = grid
        self.evaluate_fn = evaluate_fn
        self.callbacks = list(callbacks)
        self.round_timeout = round_timeout
        self._devices: dict[int, str] = {}

    def run(
        self,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        train_config: ConfigRecord | None = None,
        first_round: int = 1,
    ) -> LoopOutcome:
        arrays = initial_arrays
        for callback in self.callbacks:
            callback.on_start(arrays, first_round)
        t0 = time.monotonic()
        for rnd in range(first_round, num_rounds + 1):
            result = self.run_round(rnd, arrays, ConfigRecord(dict(train_config or {})), t0)
            arrays = result.arrays
            # Every callback sees every round (the metrics row must be written even when
            # an earlier callback asks to stop); the first reason given wins.
            reasons = [r for cb in self.callbacks if (r := cb.after_round(result))]
            if reasons:
                log(INFO, "Stopping after round %d: %s", rnd, reasons[0])
                return LoopOutcome(arrays, rnd, rnd, reasons[0])
        return LoopOutcome(arrays, num_rounds, None, "budget")

    def run_round(
        self, rnd: int, arrays: ArrayRecord, config: ConfigRecord, t0: float
    ) -> RoundResult:
        log(INFO, "[ROUND %d]", rnd)
        messages = list(self.strategy.configure_train(rnd, arrays, config, self.grid))
        bytes_down = sum(_payload_bytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=self.round_timeout))
        if len(replies) < len(messages):
            log(WARNING, "Round %d: %d of %d replies", rnd, len(replies), len(messages))
        accepted, declined, rejected = self._screen(replies, arrays)
        new_arrays, agg_metrics = self.strategy.aggregate_train(rnd, accepted)
        if new_arrays is not None:
            arrays = keep_dtypes(new_arrays, arrays)
        eval_metrics = self.evaluate_fn(rnd, arrays)
        log(INFO, "Round %d: %s", rnd, {k: v for k, v in eval_metrics.items() if "test" in k})
        return RoundResult(
            round=rnd,
            session=0,
            arrays=arrays,
            participants=[device_of(m, self._devices) for m in accepted],
            declined=declined,
            rejected=rejected,
            bytes_up=sum(_payload_bytes(m) for m in accepted),
            bytes_down=bytes_down,
            energy_spent=sum(_metric(m, "energy-spent") for m in accepted),
            train_metrics={k: float(v) for k, v in (agg_metrics or {}).items()},  # type: ignore[arg-type]
            eval_metrics=eval_metrics,
            wall_s=time.monotonic() - t0,
        )

    def _screen(
        self, replies: Iterable[Message], reference: ArrayRecord
    ) -> tuple[list[Message], list[str], list[dict[str, str]]]:
        accepted: list[Message] = []
        declined: list[str] = []
        rejected: list[dict[str, str]] = []
        # A strategy that accepts other replies than full-size arrays (CA-HFP's compact
        # submodels) brings its own check.
        check = getattr(self.strategy, "check_reply", check_train_reply)
        for msg in replies:
            device = device_of(msg, self._devices)
            if msg.has_error():
                log(INFO, "Device %s declined: %s", device, msg.error.reason)
                declined.append(device)
                continue
            reason = check(msg, reference)
            if reason:
                log(WARNING, "Dropping reply from device %s: %s", device, reason)
                rejected.append({"device": device, "reason": reason})
                continue
            accepted.append(msg)
        # Replies arrive in whatever order the devices finish; float sums depend on the
        # order, so aggregate in device order to make a seeded run repeatable.
        accepted.sort(key=lambda m: _order(device_of(m, self._devices)))
        return accepted, declined, rejected


def keep_dtypes(new: ArrayRecord, old: ArrayRecord) -> ArrayRecord:
    """``new`` with every array in the dtype it has in ``old``.

    Flower's FedAvg averages BatchNorm's int64 ``num_batches_tracked`` into a float64; the
    next round's replies (int64 again) would then fail the dtype check. Integers are
    rounded half to even, as every EdgeFleet aggregator does.
    """
    out: dict[str, Array] = {}
    changed = False
    for key, arr in new.items():
        want = old[key].dtype if key in old else arr.dtype
        if arr.dtype == want:
            out[key] = arr
            continue
        value, target = arr.numpy(), np.dtype(want)
        if np.issubdtype(target, np.integer) and not np.issubdtype(value.dtype, np.integer):
            value = np.rint(value)
        out[key] = Array(np.asarray(value, dtype=target))
        changed = True
    return ArrayRecord(out) if changed else new


def _order(device: str) -> tuple[int, int | str]:
    return (0, int(device)) if device.isdigit() else (1, device)


def _payload_bytes(msg: Message) -> int:
    if msg.has_error() or not msg.has_content():
        return 0
    return sum(rec.count_bytes() for rec in msg.content.array_records.values())


def _metric(msg: Message, key: str) -> float:
    metrics: MetricRecord | None = msg.content.metric_records.get("metrics")
    return float(metrics.get(key, 0.0)) if metrics else 0.0  # type: ignore[arg-type]
