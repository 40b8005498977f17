"""Wrapper strategies that plug into EdgeFleet's round loop.

Each EdgeFleet technique is a ``flwr.serverapp.strategy.Strategy`` that wraps another one,
the way Flower's ``DifferentialPrivacyServerSideFixedClipping`` wraps ``FedAvg``: the
message-building and aggregation calls go to the inner strategy unless the wrapper changes
them, and what happens *between* rounds (stopping, sessions) is a round callback. Since
Flower's own ``Strategy.start`` has no hook between rounds, :meth:`LoopStrategy.start` runs
EdgeFleet's :class:`~edgefleet.strategies.loop.RoundLoop` instead, with the same arguments
and the same :class:`~flwr.serverapp.strategy.Result`, so a Flower user can write::

    result = TaskVectorStopping(FedAvg()).start(grid, arrays, num_rounds=500)

and EdgeFleet's own ServerApp is only the first user of that public API.

The status query (:class:`StatusQuery`) is how energy-aware selection and sessions learn a
device's battery and presence. A ClientApp that does not answer it (no ``@app.query()``, as
in Flower's quickstart) is not an error: the node is taken as present and feasible under its
node id (``node-<id>``), once said in the log, and never asked again.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from edgefleet.bounds import MAX_LABELS, bound_reason, describe
from edgefleet.strategies.context import RoundContext, ScreeningRow, TelemetryRow, current_round
from edgefleet.strategies.hooks import StrategyHooks, hooks_of
from edgefleet.strategies.loop import RoundCallback, RoundLoop, RoundResult, numbers
from edgefleet.strategies.registry import (
    DeviceRegistry,
    DeviceStatus,
    parse_battery,
    parse_feasible,
    screen_telemetry,
)
from edgefleet.strategies.screening import RecordKeys, Screening, parse_device_id
from edgefleet.strategies.timing import exchange
from edgefleet.wire import (
    BATTERY_LEVEL,
    DEVICE_ID,
    FEASIBLE,
    LABELS,
    NUM_PARTITIONS,
    PRESENT,
    STATUS_RECORD,
    TELEMETRY_RECORD,
)

# What Flower's ClientApp raises for a message type it has no function for.
_NO_QUERY_HANDLER = "No query function registered"


@dataclass
class StatusQuery:
    """Sends the status query (carrying the global slot clock) and reads the answers.

    A node that does not answer, answers with an error or with a malformed status is left
    out: unavailable this round, never an end of the run. A node whose ClientApp has no
    query function (Flower says so in its error), or whose query function answers without a
    ``status`` record, cannot report: it is taken as present and feasible from then on
    (logged once) and not asked again (the registry's ``unreported`` nodes).

    Every answer goes through the run's :class:`~edgefleet.strategies.registry.
    DeviceRegistry`: the ``device-id`` it claims must pass the same binding rules as a
    train reply's (a node that claims another online device's id is refused, with its
    reason in the row's ``status_refused``), and the accepted ones land in the round
    context's ``status``, where every wrapper of the round finds them.

    How long to wait: ``timeout`` for nodes that have answered before; for a batch with a node
    that never has, ``first_timeout`` (when larger). A node's first answer waits for its
    ClientApp to start (a Ray actor on a loaded machine, a device loading its data), and a
    run whose first rounds gave up on starting nodes selected nobody and so depended on the
    machine's load. The wait is not what detects a dead node: Flower answers a message to a
    node that stopped heartbeating with an error once it counts as offline.
    """

    slots_per_round: int = 1
    timeout: float = 60.0
    first_timeout: float | None = None

    def ask(
        self, grid: Grid, nodes: Iterable[int], server_round: int, labels: bool = False
    ) -> dict[int, DeviceStatus]:
        ctx = current_round()
        registry = ctx.registry
        nodes = list(nodes)
        answers = {n: _assumed(registry, n) for n in nodes if n in registry.unreported}
        config = ConfigRecord(
            {
                "slot": (server_round - 1) * self.slots_per_round,
                "server-round": server_round,
                "labels": int(labels),
            }
        )
        # One content for every message, as Flower's FedAvg sends its train messages: at a
        # thousand nodes a RecordDict each was a tenth of the query's cost.
        content = RecordDict({"config": config})
        messages = [
            Message(content, dst_node_id=n, message_type=MessageType.QUERY)
            for n in nodes
            if n not in registry.unreported
        ]
        if not messages:
            ctx.status.update(answers)
            return answers
        wait = self.timeout
        if self.first_timeout is not None and any(
            m.metadata.dst_node_id not in registry.heard for m in messages
        ):
            wait = max(wait, self.first_timeout)
        new: list[int] = []
        parsed: dict[int, DeviceStatus] = {}
        # Through the loop's exchange, not Flower's send_and_receive: the deployment grid's
        # polls every 3 s, a good part of a round on fast links.
        for reply in exchange(grid, messages, [wait] * len(messages)).replies:
            node = reply.metadata.src_node_id
            registry.heard.add(node)
            if reply.has_error():
                if _NO_QUERY_HANDLER in (reply.error.reason or ""):
                    new.append(node)
                continue
            # content.get, not content.metric_records (a new typed view of the records per
            # call): a "status" record that is not a MetricRecord is no status.
            status = reply.content.get(STATUS_RECORD)
            if not isinstance(status, MetricRecord):
                new.append(node)
                continue
            one = _parse_status(node, status)
            if one is not None:
                telemetry = screen_telemetry(reply.content.get(TELEMETRY_RECORD))
                parsed[node] = replace(one, telemetry=telemetry)
        answers.update(_screened(ctx, server_round, parsed))
        if new:
            log(
                WARNING,
                "%d node(s) cannot answer EdgeFleet's status query (their ClientApp has no "
                "query function, or answers without a 'status' record): taking them as "
                "present and feasible from now on, under their node ids. Add EdgeFleet's "
                "energy_mod and status_query to that ClientApp for battery-aware selection "
                "(docs/reference/library.md).",
                len(new),
            )
            registry.unreported.update(new)
            answers.update({n: _assumed(registry, n) for n in new})
        ctx.status.update(answers)
        return answers


def _screened(
    ctx: RoundContext, server_round: int, parsed: Mapping[int, DeviceStatus]
) -> dict[int, DeviceStatus]:
    """The status answers whose device-id claim the registry accepts (bound and kept)."""
    registry = ctx.registry
    claims = {node: (node, s.device) for node, s in parsed.items()}
    # Devices that named themselves (an answer without a device-id is keyed by its node id,
    # which a restarted SuperLink draws afresh).
    registry.check_devices(s.device for n, s in parsed.items() if s.device != f"node-{n}")
    reasons = registry.screen(claims, ctx.online)
    reported = {n: s.partitions for n, s in parsed.items() if s.partitions is not None}
    reasons.update({n: r for n, r in registry.check_fleet(reported).items() if n not in reasons})
    out: dict[int, DeviceStatus] = {}
    for node, status in parsed.items():
        if node in reasons:
            reason = bound_reason(reasons[node])
            log(WARNING, "Ignoring the status of node %d: %s", node, reason)
            row = ctx.section(ScreeningRow)
            row.status_refused = [
                *(row.status_refused or []),
                {"device": registry.name(node), "reason": reason},
            ]
            continue
        out[node] = status
        if status.device == f"node-{node}":
            registry.anonymous.add(node)  # no device-id of its own: a train reply may name one
            continue
        registry.bind(node, status.device)
        registry.note_status(server_round, node, status)
        if status.telemetry.dropped:
            counts = ctx.section(TelemetryRow).telemetry_dropped
            for key in status.telemetry.dropped:
                counts[key] = counts.get(key, 0) + 1
    return out


def _assumed(registry: DeviceRegistry, node: int) -> DeviceStatus:
    """What a node that cannot report is taken to say: present and feasible, under the
    device id its train replies claimed (``node-<id>`` until one did)."""
    return DeviceStatus(device=registry.name(node), feasible=True, present=True, reported=False)


def _feasible(value: object) -> bool:
    """A status answer's ``feasible`` (absent: 1, a ClientApp without batteries); anything
    but 0 or 1 makes the answer malformed (NaN, 0.5 or a list once counted as feasible)."""
    feasible = parse_feasible(value)
    if feasible is None:
        raise ValueError(f"feasible ({describe(value)}) is not 0 or 1")
    return feasible


def _partitions(node: int, value: object) -> int | None:
    """A reported ``num-partitions`` (a whole number in [1, 10^7]), or None."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10**7:
        log(WARNING, "Node %d: num-partitions (%s) is not a whole number in [1, 1e7]; dropped",
            node, describe(value))  # fmt: skip
        return None
    return value


def _labels(value: object) -> tuple[int, ...]:
    """A status answer's ``labels``: at most MAX_LABELS class indices, each a whole number in
    [0, MAX_LABELS); else ValueError (the answer is malformed: no data set of an honest
    device has more classes, and the sessions wrapper writes their union into every row)."""
    if not isinstance(value, list):
        raise ValueError(f"labels ({describe(value)}) is not a list")
    if len(value) > MAX_LABELS:
        raise ValueError(f"labels is a list of {len(value):,} (at most {MAX_LABELS})")
    if not all(_class_index(c) for c in value):
        raise ValueError(f"labels must be whole numbers in [0, {MAX_LABELS})")
    return tuple(int(c) for c in value)


def _class_index(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and 0 <= value < MAX_LABELS
        and float(value).is_integer()
    )


def _parse_status(node: int, status: MetricRecord) -> DeviceStatus | None:
    raw_id = status.get(DEVICE_ID)
    device = f"node-{node}" if raw_id is None else parse_device_id(raw_id)
    if device is None:
        log(WARNING, "Ignoring a malformed status from node %d: device-id (%s)", node,
            describe(raw_id))  # fmt: skip
        return None
    try:
        return DeviceStatus(
            device=device,
            feasible=_feasible(status.get(FEASIBLE, 1)),
            present=bool(status.get(PRESENT, 1)),
            labels=_labels(status.get(LABELS, [])),
            battery=parse_battery(node, status.get(BATTERY_LEVEL)),
            partitions=_partitions(node, status.get(NUM_PARTITIONS)),
        )
    except (TypeError, ValueError, OverflowError) as err:  # int(inf) is an OverflowError
        log(WARNING, "Ignoring a malformed status from node %d: %s", node, bound_reason(err))
        return None


class SubsetGrid:
    """The grid as an inner strategy should see it: only ``node_ids`` (those still online).

    Each call asks the grid below, so the round loop's bound on waiting for nodes holds
    here too: a FedAvg asked to sample 2 of an empty subset used to wait for good."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        self._grid, self._nodes = grid, node_ids

    def get_node_ids(self) -> list[int]:
        online = set(self._grid.get_node_ids())
        return [n for n in self._nodes if n in online]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class LoopStrategy(StrategyHooks, Strategy):
    """Delegates every Strategy call and every hook to ``inner``; a subclass that is also a
    :class:`~edgefleet.strategies.loop.RoundCallback` is called after every round."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    # -- hooks: passed down to the inner strategy -----------------------------------------

    def round_callbacks(self) -> list[RoundCallback]:
        """Callbacks of this wrapper and of every wrapper inside it, innermost first."""
        return hooks_of(self.inner).round_callbacks() + self.own_callbacks()

    def own_callbacks(self) -> list[RoundCallback]:
        return [self] if isinstance(self, RoundCallback) else []

    def on_session(self, arrays: ArrayRecord | None) -> None:
        hooks_of(self.inner).on_session(arrays)

    def on_status(self, server_round: int, answers: Any) -> None:
        hooks_of(self.inner).on_status(server_round, answers)

    def register_devices(self, device_ids: Iterable[str]) -> None:
        hooks_of(self.inner).register_devices(device_ids)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (nested per wrapper)."""
        return {"inner": hooks_of(self.inner).state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hooks_of(self.inner).load_state_dict(state.get("inner", {}))

    def check_reply(self, msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None:
        """The innermost wrapper that knows the reply format decides (full-size arrays
        unless a wrapper such as CA-HFP's accepts submodels)."""
        return hooks_of(self.inner).check_reply(msg, reference, keys)

    def update_norm(self, msg: Message, sent: RecordDict | None, reference: ArrayRecord) -> float:
        return hooks_of(self.inner).update_norm(msg, sent, reference)

    # -- Strategy -------------------------------------------------------------------------

    def settings(self) -> dict[str, object]:
        """This wrapper's own settings, for :meth:`summary`."""
        return {}

    def summary(self) -> None:
        """This wrapper's settings, then the inner strategy's (as Flower's DP wrappers do)."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        items = list(self.settings().items()) or [("(none)", "")]
        for i, (key, value) in enumerate(items):
            log(INFO, "\t│\t%s── %s: %s", "└" if i == len(items) - 1 else "├", key, value)
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop: the arguments
        and the ``Result`` of :func:`start_on_loop`."""
        return start_on_loop(self, grid, initial_arrays, *args, **kwargs)


W = TypeVar("W")


def find_wrapper(strategy: object, kind: type[W]) -> W | None:
    """The outermost wrapper of type ``kind`` in ``strategy``'s chain (``.inner`` links)."""
    while strategy is not None:
        if isinstance(strategy, kind):
            return strategy
        strategy = getattr(strategy, "inner", None)
    return None


def build_loop(
    strategy: Strategy,
    grid: Grid,
    *,
    before: Sequence[RoundCallback] = (),
    after: Sequence[RoundCallback] = (),
    **loop_kwargs: Any,
) -> RoundLoop:
    """The round loop for ``strategy``: its wrappers' callbacks (innermost first), between
    ``before`` and ``after`` (EdgeFleet's ServerApp puts its metrics writer and checkpoint
    after them, so that they record what the wrappers wrote). ``loop_kwargs`` go to
    :class:`~edgefleet.strategies.loop.RoundLoop`. The one way both
    :func:`start_on_loop` and EdgeFleet's ServerApp build it."""
    from edgefleet.strategies.energy import EnergyAgeSelection  # imports this module
    from edgefleet.strategies.robust import participant_cap_error

    selection = find_wrapper(strategy, EnergyAgeSelection)
    why = participant_cap_error(strategy, selection.max_devices if selection else None)
    if why:  # before round 1, not a run that never aggregates
        raise ValueError(why)
    callbacks = [*before, *hooks_of(strategy).round_callbacks(), *after]
    return RoundLoop(strategy, grid, callbacks=callbacks, **loop_kwargs)


def start_on_loop(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int = 3,
    timeout: float = 3600,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    *,
    screening: Screening | None = None,
) -> Result:
    """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop.

    As in Flower: the summary is logged first; ``evaluate_fn`` is called on the initial
    model (round 0) and after every round; federated evaluation runs when the inner
    strategy's ``fraction_evaluate`` > 0; the returned ``Result`` holds the final arrays
    and every round's aggregated train, federated-evaluation and central metrics (a round
    that kept the model as it was holds the last evaluation's figures, without a second
    pass). The one difference: a round callback may end the run before ``num_rounds`` (a
    stopping rule). ``screening`` (EdgeFleet's addition) sets the bounds replies are
    screened against (:class:`~edgefleet.strategies.screening.Screening`; e.g.
    ``max_examples`` when your ClientApp's sample count per round is known).
    """
    log(INFO, "Starting %s strategy:", type(strategy).__name__)
    log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
    strategy.summary()
    log(INFO, "")
    result = Result(arrays=initial_arrays)
    central: dict[int, MetricRecord] = result.evaluate_metrics_serverapp
    last: list[MetricRecord] = []  # the last record evaluate_fn returned

    def evaluate(rnd: int, arrays: ArrayRecord) -> dict[str, float]:
        res = evaluate_fn(rnd, arrays) if evaluate_fn else None
        if res is None:
            return {}
        central[rnd] = res
        last[:] = [res]
        return numbers(res)

    if evaluate_fn is not None:
        log(INFO, "Initial global evaluation results: %s", evaluate(0, initial_arrays))

    class Collect(RoundCallback):
        def after_round(self, res: RoundResult) -> str | None:
            if res.train_metrics:
                result.train_metrics_clientapp[res.round] = MetricRecord(dict(res.train_metrics))
            if res.federated_metrics:
                result.evaluate_metrics_clientapp[res.round] = MetricRecord(
                    dict(res.federated_metrics)
                )
            if res.evaluated and res.round not in central and last:
                central[res.round] = last[0]  # the loop reused the last figures
            return None

    loop = build_loop(
        strategy,
        grid,
        before=[Collect()],
        evaluate_fn=evaluate if evaluate_fn is not None else None,
        evaluate_config=evaluate_config,
        round_timeout=timeout,
        screening=screening,
    )
    outcome = loop.run(initial_arrays, num_rounds, train_config)
    result.arrays = outcome.arrays
    log(INFO, "")
    log(INFO, "Run ended after round %d (%s). Final results:", outcome.rounds_run,
        outcome.stop_reason)  # fmt: skip
    for line in io.StringIO(str(result)):
        log(INFO, "\t%s", line.strip("\n"))
    return result
