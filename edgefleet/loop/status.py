"""The status phase: the round loop asks the fleet once a round, for every wrapper.

Energy-aware selection needs each device's battery, sessions need who is present; both come
from one light ``query`` message (the *status query*, :class:`StatusQuery`) carrying the
fleet's slot clock. A wrapper never sends it: it *declares* what it needs
(:class:`Declaration`, through the hook ``declarations``) and the loop's
:class:`StatusPhase` asks, once a round before ``configure_train``:

1. every online node, when a component needs every device's presence (sessions);
2. then the nodes the wrappers plan to ask (the hook ``plan_status``: energy-aware selection
   asks newcomers, then devices in age order a batch at a time until M feasible ones have
   answered, skipping the ones whose earlier answer is still good, ``status_max_age``).
   A node already answered this round is never asked again.

The answers are screened and recorded in the run's
:class:`~edgefleet.loop.registry.DeviceRegistry` and land in the round context's
``status``, where every wrapper reads them; an error answer is logged with its reason and
kept in ``status_errors`` (unknown this round, not departed).

The facts a round's messages must agree on (:class:`~edgefleet.loop.context.
FleetFacts`: the energy slot clock and the participant cap) are declared the same way and
merged once, before round 1 (:func:`fleet_facts`): two components that declare different
clocks are refused with both values, one that declares none follows the fleet's.

A ClientApp that does not answer the query (no ``@app.query()``, as in Flower's
quickstart) is not an error: the node is taken as present and feasible under its node id
(``node-<id>``), once said in the log, and never asked again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from edgefleet.bounds import MAX_LABELS, MAX_REASON_CHARS, bound_reason, describe
from edgefleet.loop.context import (
    FleetFacts,
    RoundContext,
    ScreeningRow,
    TelemetryRow,
    current_round,
)
from edgefleet.loop.hooks import hooks_of
from edgefleet.loop.registry import (
    DeviceRegistry,
    DeviceStatus,
    parse_battery,
    parse_feasible,
    screen_telemetry,
)
from edgefleet.loop.screening import parse_device_id
from edgefleet.loop.timing import exchange
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

if TYPE_CHECKING:
    from flwr.serverapp.strategy import Strategy

# What Flower's ClientApp raises for a message type it has no function for.
_NO_QUERY_HANDLER = "No query function registered"

# How much of a device's error reason reaches the log (it is device input): the one cap on
# reasons (edgefleet/bounds.py), re-exported for the tests.
REASON_CHARS = MAX_REASON_CHARS

# Asks the given nodes this round's status query; returns the answers of those asked.
Ask = Callable[[Sequence[int]], Mapping[int, DeviceStatus]]


class FleetConflict(ValueError):
    """Two components declare different values of one fleet fact."""


@dataclass(frozen=True)
class Declaration:
    """What one component declares of the fleet and needs of the status phase.

    ``owner`` names it in an error. ``slots_per_round`` / ``participant_cap``: its value of
    the fleet's fact (None: it declares none and follows the others'). ``status``: it needs
    the status phase; ``every_node``: every online node asked every round (presence);
    ``labels``: the answers must name the device's classes. ``timeout`` /
    ``first_timeout``: how long it would wait for an answer (the phase waits the longest
    any component asks for). ``round_barrier``: why it needs the synchronous round (the
    asynchronous loop refuses it with this reason). ``device_memory``: it keeps each
    device's last update and counts it in every model (SAGA memory), so it already gives
    rarely replying devices their share (the asynchronous loop refuses participation
    weights beside it). ``dispatch``: in the asynchronous loop it chooses which idle device
    starts when a slot frees (the hook ``choose_to_start``, asking statuses on the slot
    clock), so its ``status`` need is met there too."""

    owner: str
    slots_per_round: int | None = None
    participant_cap: int | None = None
    status: bool = False
    every_node: bool = False
    labels: bool = False
    timeout: float | None = None
    first_timeout: float | None = None
    round_barrier: str | None = None
    device_memory: bool = False
    dispatch: bool = False


def fleet_facts(declarations: Iterable[Declaration]) -> FleetFacts:
    """The run's one :class:`FleetFacts` from every component's declaration; two different
    values of one fact are a :class:`FleetConflict` naming both (before round 1)."""
    found: dict[str, tuple[str, int]] = {}
    for d in declarations:
        for fact in ("slots_per_round", "participant_cap"):
            value = getattr(d, fact)
            if value is None:
                continue
            if fact == "slots_per_round" and not (isinstance(value, int) and value >= 1):
                raise FleetConflict(f"{d.owner}: slots_per_round={value!r} must be an int >= 1")
            if fact in found and found[fact][1] != value:
                other, theirs = found[fact]
                raise FleetConflict(
                    f"{other} declares {fact}={theirs} and {d.owner} {fact}={value}: the fleet "
                    f"has one {'energy slot clock' if fact == 'slots_per_round' else 'cap'}. "
                    f"Give both the same value, or leave {d.owner}'s out (it then follows "
                    f"{other}'s)"
                )
            found.setdefault(fact, (d.owner, value))
    return FleetFacts(
        slots_per_round=found["slots_per_round"][1] if "slots_per_round" in found else 1,
        participant_cap=found["participant_cap"][1] if "participant_cap" in found else None,
    )


class StatusPhase:
    """The loop's status phase for ``strategy`` (module docstring): None of it runs when no
    component declares that it needs status."""

    def __init__(self, strategy: Strategy, declarations: Sequence[Declaration]) -> None:
        self.hooks = hooks_of(strategy)
        self.fleet = fleet_facts(declarations)
        needs = [d for d in declarations if d.status]
        self.needed = bool(needs)
        self.every_node = any(d.every_node for d in needs)
        self.labels = any(d.labels for d in needs)
        timeouts = [d.timeout for d in needs if d.timeout is not None]
        firsts = [d.first_timeout for d in needs if d.first_timeout is not None]
        self.query = StatusQuery(
            self.fleet.slots_per_round,
            max(timeouts, default=60.0),
            max(firsts) if firsts else None,
        )

    def run(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> None:
        """Ask this round's statuses (into the current round's context)."""
        if not self.needed:
            return
        ctx = current_round()
        online = sorted(n for n in grid.get_node_ids() if n not in ctx.registry.retired)

        def ask(nodes: Sequence[int]) -> Mapping[int, DeviceStatus]:
            todo = [n for n in nodes if n not in ctx.status and n not in ctx.status_errors]
            if todo:
                self.query.ask(grid, todo, server_round, labels=self.labels)
            return {n: ctx.status[n] for n in nodes if n in ctx.status}

        if self.every_node:
            ask(online)
        self.hooks.plan_status(server_round, arrays, online, ask)


@dataclass
class StatusQuery:
    """Sends the status query (carrying the global slot clock) and reads the answers.

    A node that does not answer, answers with an error or with a malformed status is left
    out: unavailable this round, never an end of the run. A node whose ClientApp has no
    query function (Flower says so in its error), or whose query function answers without a
    ``status`` record, cannot report: it is taken as present and feasible from then on
    (logged once) and not asked again (the registry's ``unreported`` nodes).

    Every answer goes through the run's :class:`~edgefleet.loop.registry.
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
                reason = reply.error.reason or ""
                if _NO_QUERY_HANDLER in reason:
                    new.append(node)
                    continue
                why = bounded_reason(reply)
                if is_unreachable(reply):  # gone (a killed SuperNode): no answer, as a timeout
                    log(INFO, "Node %d unreachable for the status query: %s", node, why)
                    continue
                log(WARNING, "Node %d (device %s) answered the status query with an error "
                    "(unknown this round, not departed): %s", node, registry.name(node),
                    why)  # fmt: skip
                ctx.status_errors[node] = why
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
                "(README: 'Use EdgeFleet's strategies in your own Flower app').",
                len(new),
            )
            registry.unreported.update(new)
            answers.update({n: _assumed(registry, n) for n in new})
        ctx.status.update(answers)
        return answers


# Error codes that the transport sets, not the device: Flower's SuperLink answers a message
# to a node that stopped heartbeating with NODE_UNAVAILABLE, and a lost message or reply with
# the *_UNAVAILABLE codes (flwr/server/superlink/linkstate/utils.py).
TRANSPORT_ERRORS = frozenset(
    {ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE}
)


def is_unreachable(msg: Message) -> bool:
    """Whether an error reply says the device could not be reached (its own error, such as
    the energy mod's decline, says it was reached and refused)."""
    return msg.error.code in TRANSPORT_ERRORS


def bounded_reason(reply: Message) -> str:
    """An error reply's code and reason, the reason cut by :func:`~edgefleet.bounds.
    bound_reason` (device input)."""
    return bound_reason(f"code {reply.error.code}: {reply.error.reason or '(no reason)'}")


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
