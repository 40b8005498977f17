"""Asynchronous, buffered aggregation (FedBuff) on Flower's Grid: no round barrier.

A synchronous round waits for its slowest device or drops it. Here (FedBuff, Nguyen et al.,
"Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022) the server keeps
up to ``concurrency`` devices training at once, pulls replies as they arrive, and makes a new
global model (a *version*) every ``buffer_size`` accepted replies, each discounted by how many
versions old its base model is (:mod:`edgefleet.loop.staleness`). A device that
finishes is sent the current model at once (the idle device that has waited longest gets a
freed slot when there are more devices than slots). Choose it over the synchronous loop when
devices or links differ by much: a slow device's update still counts (discounted) and nobody
waits for it.

It uses nothing but ``Grid.push_messages`` / ``pull_messages`` (polled every ``poll_s``), so
the same code runs on the in-process engine, Flower's Simulation Engine and the Deployment
Engine. On the Deployment Engine each outstanding reply is pulled in a thread of its own
(:mod:`edgefleet.loop.pulling`): Flower's pull downloads a reply's arrays inside the call,
and one device's slow upload would otherwise keep the loop from seeing everyone else's.

Replies are screened one at a time as the synchronous loop screens them
(:mod:`edgefleet.loop.screening`: well-formed, within the server's bounds, a device
id that is its node's, an update norm at most ``norm_factor`` x the median of recently
accepted norms); a reply more than ``max_staleness`` versions old is dropped with that
reason. Every drop is logged and lands in the version's row (``rejected``), bounded.

Composition with the inner strategy: each buffered reply is *rebased* onto the current
model, ``x + w(s_i) (y_i - base_i)``, and the buffer is handed to the inner strategy's
``aggregate_train``; its result ``x'`` becomes ``x + server_lr (x' - x)``. With Flower's
FedAvg inside this is FedBuff's step weighted by ``num-examples``
(:func:`~edgefleet.loop.staleness.fedbuff_step`), with
:class:`~edgefleet.strategies.equalweight.EqualWeightFedAvg` exactly FedBuff's ``1/K``; a robust
rule (:class:`~edgefleet.strategies.robust.RobustAggregation`, Flower's ``FedMedian``...)
runs over the buffer; FedSAG keeps each device's last (staleness-weighted) update in its
memory, which is asynchronous by nature. Train messages come from the inner strategy's own
``configure_train`` (once per version, as a template re-addressed to each device), so its
config (FedProx's ``proximal-mu``, ``server-round`` = the version being built) is what the
devices see.

Each version is one :class:`~edgefleet.loop.roundloop.RoundResult` (``round`` = version)
handed to the round callbacks, with the asynchronous columns in ``extra``: ``version``,
``accepted``, ``dropped``, ``staleness_min/median/max``, ``in_flight``.

Who starts when a slot frees: the longest idle device, unless a wrapper declares that it
chooses (``Declaration.dispatch``: energy-age selection). Then the loop asks it
(``choose_to_start``) with the idle nodes and the free slots, and it asks their batteries
on the fleet's slot clock, which moves a round per version and one more whenever nobody
trains and no idle device can pay (``max_empty`` such rounds in a row end the run).

Not yet (refused by EdgeFleet's ServerApp before a run starts, see
``docs/how-to/async-aggregation.md``): CA-HFP's compact download and its ``zeros`` /
``elementwise`` reconstructions, sessions, validation stopping, federated evaluation, a
selection deadline. CA-HFP submodels themselves are made full size against their own
version by the strategy's ``full_size_reply`` hook before the rebase.

Checkpoints: :meth:`AsyncLoop.state_dict` holds, besides the device registry, the replies
accepted into the buffer but not yet aggregated (their arrays, the base models they were
trained from, their staleness; at most ``buffer_size`` replies and as many bases) and the
devices in flight. ``checkpoint`` (EdgeFleet's ServerApp passes its checkpointer) is called
after every reply that enters the buffer without filling it, and the round callbacks
checkpoint each version, so a run stopped mid-buffer loses no accepted update: resumed,
it starts with that buffer and first re-sends the current model to the devices that were
training (their replies to the stopped run are gone with its messages).
"""

from __future__ import annotations

import io
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from edgefleet.bounds import bound_reason
from edgefleet.loop.base import LoopStrategy, participant_cap_error
from edgefleet.loop.context import RoundContext, in_round
from edgefleet.loop.hooks import hooks_of
from edgefleet.loop.pulling import ReplyPuller, pulls_wait_on_uploads
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import (
    EvaluateFn,
    Evaluation,
    LoopOutcome,
    RoundCallback,
    RoundResult,
    device_order,
    energy_after,
    keep_dtypes,
    numbers,
    payload_bytes,
)
from edgefleet.loop.screening import (
    NORM_HISTORY_ROUNDS,
    RecordKeys,
    Screening,
    array_values,
    check_bounds,
    claimed_device,
    common_metrics,
    first_metrics,
    model_norm,
    norm_reference,
    reply_metrics,
)
from edgefleet.loop.staleness import (
    PARTICIPATION_WEIGHTS,
    SERVER_LR_SCHEDULES,
    STALENESS_FUNCTIONS,
    AsyncSettings,
    summarise,
)
from edgefleet.loop.status import StatusPhase, bounded_reason, fleet_facts, is_unreachable
from edgefleet.loop.timing import DEFAULT_POLL_S, LinkEstimate
from edgefleet.settings import at_least, choice, positive, setting
from edgefleet.wire import DISPATCH, ENERGY_SPENT, TRAIN_TIME

# A version's row keeps at most this many drop reasons (the rest are counted): a fleet of
# broken devices must not grow a row without bound.
MAX_REASONS = 20
# What a checkpoint's row so far may hold (a file is data: bounded as it is read back).
_MAX_LISTED = 10_000  # entries of a list (far above any concurrency)
_MAX_NAME = 128  # characters of a device name
# A run ends (with the reason) after this many x max(buffer, concurrency) unusable replies in
# a row, or this many buffers in a row that the inner strategy could not aggregate.
STALL_REPLIES = 20
MAX_FAILED_BUFFERS = 10
# Nodes a template grid shows at least, so that a FedAvg-family configure_train never waits
# for its min_available_nodes (the loop addresses each message itself).
_FAKE_NODE = 2**62


AGGREGATION_MODES: tuple[str, ...] = ("sync", "async")


@dataclass(frozen=True)
class AsyncConfig:
    """``aggregation.mode`` and ``async.*``: buffered asynchronous aggregation (FedBuff;
    :mod:`edgefleet.loop.asyncloop`, docs/how-to/async-aggregation.md). In async mode
    ``num-server-rounds`` counts global model versions and ``round-timeout`` bounds one
    device's training."""

    mode: str = setting(
        "aggregation.mode",
        "sync",
        choice(AGGREGATION_MODES),
        "`sync` (rounds with a barrier) or `async` (FedBuff: a new model every "
        "`async.buffer-size` replies, no barrier)",
    )
    concurrency: int = setting(
        "async.concurrency", 10, at_least(1), "async: devices training at once"
    )
    buffer_size: int = setting(
        "async.buffer-size", 5, at_least(1), "async: accepted replies per new global model (K)"
    )
    staleness: str = setting(
        "async.staleness",
        "polynomial",
        choice(STALENESS_FUNCTIONS),
        "async: staleness weight, `polynomial` (1+s)^-a, `constant` 1, `hinge` (1 up to b, "
        "then 1/(a(s-b)+1))",
    )
    staleness_a: float = setting(
        "async.staleness-a", 0.5, at_least(0.0), "async: `a` of the polynomial and hinge weights"
    )
    staleness_b: int = setting(
        "async.staleness-b", 4, at_least(0), "async: `b` of the hinge weight (versions)"
    )
    server_lr: float = setting(
        "async.server-lr", 1.0, positive, "async: server learning rate of each version's step"
    )
    server_lr_schedule: str = setting(
        "async.server-lr-schedule",
        "constant",
        choice(SERVER_LR_SCHEDULES),
        "async: `constant` server step, or `cosine` from `async.server-lr` down to "
        "`async.server-lr-min` over the run's versions",
    )
    server_lr_min: float = setting(
        "async.server-lr-min",
        0.0,
        at_least(0.0),
        "async: where the `cosine` server step ends (at most `async.server-lr`)",
    )
    participation: str = setting(
        "async.participation",
        "none",
        choice(PARTICIPATION_WEIGHTS),
        "async: `none`, or `interval`: each update also weighted by its device's participation "
        "interval in versions (FedAU), so rarely replying devices are not under-represented",
    )
    participation_cap: float = setting(
        "async.participation-cap",
        4.0,
        at_least(1.0),
        "async: the `interval` weight is kept within [1/cap, cap]",
    )
    max_staleness: int = setting(
        "async.max-staleness",
        0,
        at_least(0),
        "async: drop replies more than this many versions old (0 = keep all)",
    )

    @property
    def enabled(self) -> bool:
        return self.mode == "async"


@dataclass
class Flight:
    """A train message out: to ``node``, carrying version ``version`` (``base``)."""

    node: int
    version: int
    base: ArrayRecord
    content: RecordDict
    pushed_at: float
    nbytes: int


@dataclass
class Buffered:
    msg: Message
    staleness: int
    base: ArrayRecord
    device: str
    version: int = 0  # the version of ``base``


@dataclass
class _Period:
    """What happened while one version was being built (its row)."""

    accepted: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    dropped_more: int = 0
    staleness: list[int] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0


class _TemplateGrid:
    """The grid as the inner strategy's ``configure_train`` sees it: at least ``need`` nodes,
    so that its sampling never waits; the loop only takes one message's content."""

    def __init__(self, grid: Grid, need: int) -> None:
        self._grid, self._need = grid, need

    def get_node_ids(self) -> list[int]:
        nodes = list(self._grid.get_node_ids())
        return nodes + [_FAKE_NODE + i for i in range(max(0, self._need - len(nodes)))]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def _min_nodes(strategy: object) -> int:
    need = 1
    while strategy is not None:
        for attr in ("min_available_nodes", "min_train_nodes"):
            value = getattr(strategy, attr, None)
            if isinstance(value, int):
                need = max(need, value)
        strategy = getattr(strategy, "inner", None)
    return need


class AsyncLoop:
    """Drive ``strategy`` asynchronously over ``grid`` (module docstring) for up to
    ``num_versions`` new global models.

    ``evaluate_fn`` (central evaluation) runs every ``evaluate_every`` versions and on the
    last; ``reply_timeout`` bounds how long one device may hold a slot; ``clock`` is the
    loop's time (a virtual-time test grid hands its own).
    """

    def __init__(
        self,
        strategy: Strategy,
        grid: Grid,
        settings: AsyncSettings,
        *,
        evaluate_fn: EvaluateFn | None = None,
        evaluate_every: int = 1,
        callbacks: Sequence[RoundCallback] = (),
        screening: Screening | None = None,
        reply_timeout: float = 600.0,
        node_wait_timeout: float = 60.0,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        checkpoint: Callable[[int, ArrayRecord], None] | None = None,
        background_pull: bool | None = None,
        max_empty: int = 3,
    ) -> None:
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every={evaluate_every!r} must be >= 1")
        why = participant_cap_error(strategy, settings.buffer_size)
        if why:
            raise ValueError(why.replace("devices are selected a round", "replies a buffer"))
        declarations = hooks_of(strategy).declarations()
        # Refused before the first version (compose or refuse): these need a round barrier.
        for d in declarations:
            if d.status and not d.dispatch:
                raise ValueError(
                    f"{d.owner} needs the round loop's status phase (it chooses devices or "
                    "sessions from one status query a round); the asynchronous loop has none"
                )
            if d.round_barrier:
                raise ValueError(d.round_barrier)
            if d.device_memory and settings.participation != "none":
                raise ValueError(
                    f"participation weights ({settings.participation!r}) with {d.owner}'s "
                    "memory: the memory already counts every device's last update in each "
                    "model, and the weight would count a rare device's stored update up to "
                    "the cap times in every one. Use one of them"
                )
        self.fleet = fleet_facts(declarations)
        # A component that chooses who starts (energy-age selection) is asked whenever slots
        # free, its statuses on the slot clock: a round of it per version, and one more
        # whenever nobody is training and no idle device can afford to (as an empty
        # synchronous round moves it), so that batteries harvest. ``max_empty`` such rounds
        # in a row end the run (run.max-empty-rounds).
        chooses = any(d.dispatch for d in declarations)
        self._query = StatusPhase(strategy, declarations).query if chooses else None
        self.max_empty = max_empty
        self._ticks = 0  # slot-clock rounds moved on without a version (checkpointed)
        self._empty = 0  # of them in a row
        self._nobody_for: tuple[int, tuple[int, ...], int] | None = None  # see _choose
        self.strategy, self.grid, self.settings = strategy, grid, settings
        self.evaluate_fn, self.evaluate_every = evaluate_fn, evaluate_every
        self.callbacks = [*hooks_of(strategy).round_callbacks(), *callbacks]
        self.screening = screening or Screening()
        self.registry = DeviceRegistry(self.screening.device_binding)
        self.keys = RecordKeys.of(strategy)
        self.hooks = hooks_of(strategy)
        self.reply_timeout, self.node_wait_timeout = reply_timeout, node_wait_timeout
        interval = getattr(grid, "pull_interval", None)
        self.poll_s = poll_s or (interval if isinstance(interval, float) else DEFAULT_POLL_S)
        self.clock, self.sleep = clock, sleep
        # None: pulled in the background where a pull waits on uploads (edgefleet.loop.pulling)
        self.background_pull = (
            pulls_wait_on_uploads(grid) if background_pull is None else background_pull
        )
        self._puller = ReplyPuller(grid, self.background_pull, self.poll_s)
        self.norms: deque[float] = deque(maxlen=NORM_HISTORY_ROUNDS * settings.buffer_size)
        self._node_links: dict[int, LinkEstimate] = {}
        self._started: dict[int, int] = {}  # node -> dispatch count when it last started
        self.checkpoint = checkpoint
        # The running loop's version, buffer, flights, period and dispatch count, for
        # state_dict (empty before a run).
        self._live: Callable[[], tuple[int, list[Buffered], dict[str, Flight], _Period, int]]
        self._live = lambda: (0, [], {}, _Period(), 0)
        self._restored: dict[str, Any] = {}  # what load_state_dict found of a stopped buffer
        self._num_versions = 0
        # Accepted updates per device (participation weights), every device under the name
        # its rows use: the registry counts only devices bound to an id, and a ClientApp
        # without EdgeFleet's mods has none. A resumed run starts from the registry's counts.
        self._updates: dict[str, int] = {}
        # A device's interval counts from the version at which it joined the fleet (its node
        # first seen connected), not from the run's start: a device that arrives at version 100
        # has not been absent for 100 versions. The fleet's size n counts the devices that
        # have sent an update and are connected now: a departed one no longer shrinks every
        # weight.
        self._joined: dict[str, int] = {}
        self._node_of: dict[str, int] = {}  # device -> node of its last accepted update
        self._seen: dict[int, int] = {}  # connected node -> version it was first seen at

    # -- the run ----------------------------------------------------------------------------

    def run(
        self,
        initial_arrays: ArrayRecord,
        num_versions: int,
        train_config: ConfigRecord | None = None,
        first_version: int = 1,
    ) -> LoopOutcome:
        """Make versions ``first_version`` .. ``num_versions`` from ``initial_arrays`` (a
        resumed run starts from its checkpoint's version + 1: devices that were training
        when it stopped are simply sent the model again)."""
        try:
            return self._run(initial_arrays, num_versions, train_config, first_version)
        finally:
            self._puller.close()

    def _run(
        self,
        initial_arrays: ArrayRecord,
        num_versions: int,
        train_config: ConfigRecord | None,
        first_version: int,
    ) -> LoopOutcome:
        s = self.settings
        arrays, version = initial_arrays, first_version - 1
        for callback in self.callbacks:
            callback.on_start(arrays, first_version)
        t0 = self.clock()
        flights: dict[str, Flight] = {}
        buffer: list[Buffered] = []
        period = _Period()
        dispatches = 0
        resend: dict[int, int] = {}  # node -> rank: in flight when a stopped run checkpointed
        kept = self._restored
        self._restored = {}
        if kept and kept["version"] == version:
            buffer, period, dispatches = kept["buffer"], kept["period"], kept["dispatches"]
            resend = {node: i for i, node in enumerate(kept["in_flight"])}
            log(INFO, "Resumed mid-buffer: %d buffered update(s) kept; re-sending version "
                "%d to the %d device(s) that were training", len(buffer), version,
                len(resend))  # fmt: skip
        elif kept:
            log(WARNING, "The checkpoint's buffer is for version %d, this run starts after "
                "version %d: not used", kept["version"] + 1, version)  # fmt: skip

        def live() -> tuple[int, list[Buffered], dict[str, Flight], _Period, int]:
            return version, buffer, flights, period, dispatches

        self._live = live
        self._num_versions = num_versions  # (the server step's schedule spans the run)
        self._updates = {d: r.participation.count for d, r in self.registry.devices.items()
                         if r.participation.count}  # fmt: skip
        self._joined = {d: r.participation.joined for d, r in self.registry.devices.items()
                        if r.participation.joined is not None}  # fmt: skip
        bound = {d: self.registry.devices[d].node for d in self._updates}
        self._node_of = {d: n for d, n in bound.items() if n not in self.registry.retired}
        ctx = self._context(version + 1)
        template = self._template(ctx, version + 1, arrays, train_config)
        idle_since: float | None = None
        final: dict[str, float] = {}
        wasted, failed = 0, 0  # replies unusable / buffers unaggregated, in a row
        stall = STALL_REPLIES * max(s.buffer_size, s.concurrency)
        while version < num_versions:
            if template is None:
                return self._end(arrays, version, "the strategy configured no train message")
            # Fill the free slots, longest-idle device first (or whom the strategy chooses).
            free = s.concurrency - len(flights)
            busy = {f.node for f in flights.values()}
            # (Asking a deployment's SuperLink for its nodes only when a slot is free.)
            nodes = self.grid.get_node_ids() if free > 0 else []
            if free > 0:  # (bounded: the nodes connected now)
                self._seen = {n: self._seen.get(n, version) for n in nodes}
            idle = [n for n in nodes if n not in busy]
            # (A resumed run's devices that were in flight first, in their order.)
            idle.sort(key=lambda n: (resend.get(n, len(resend)), self._started.get(n, -1), n))
            rnd = version + 1 + self._ticks  # the slot clock's round
            slot = None if self._query is None else self.fleet.slot(rnd)
            start = (
                idle[:free]
                if slot is None or not idle
                else self._choose(ctx, rnd, arrays, idle, free)
            )
            out = []
            for i, node in enumerate(start):
                msg = Message(
                    _numbered(template.content, dispatches + i + 1, slot), dst_node_id=node,
                    message_type=MessageType.TRAIN, group_id=template.metadata.group_id,
                )  # fmt: skip
                out.append(msg)
            if out:
                now = self.clock()
                # Pushing stamps each message with its id; one the grid refused (a node that
                # left) is not among the ids returned.
                pushed = set(self.grid.push_messages(out))
                for msg in out:
                    mid = msg.metadata.message_id
                    if not mid or mid not in pushed:
                        continue
                    nbytes = payload_bytes(msg)
                    flights[mid] = Flight(
                        msg.metadata.dst_node_id, version, arrays, template.content, now, nbytes
                    )
                    dispatches += 1
                    self._started[msg.metadata.dst_node_id] = dispatches
                    resend.pop(msg.metadata.dst_node_id, None)
                    period.bytes_down += nbytes
                    if slot is not None:
                        self._spends(ctx, msg.metadata.dst_node_id)
                        self._empty = 0
            if not flights and slot is not None and idle:
                # Devices are there, and none that answered can afford to train.
                why = self._tick(ctx, rnd)
                if why:
                    return self._end(arrays, version, why)
                continue
            if not flights:
                now = self.clock()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since > self.node_wait_timeout:
                    return self._end(arrays, version, "no node to train on")
                self.sleep(self.poll_s)
                continue
            idle_since = None
            # (In the background the pull itself waits for a reply, up to a poll.)
            replies = self._puller.pull(list(flights), self.poll_s if self.background_pull else 0)
            now = self.clock()
            # A device that has held its slot too long loses it (checked on every poll: the
            # others' replies keep coming meanwhile); a later reply of its is ignored.
            for mid, f in list(flights.items()):
                if now - f.pushed_at > self.reply_timeout and not any(
                    r.metadata.reply_to_message_id == mid for r in replies
                ):
                    del flights[mid]
                    self._link(f.node).timed_out(self.reply_timeout)
                    self._drop(period, self.registry.name(f.node),
                               f"no reply within {self.reply_timeout:g} s")  # fmt: skip
            if not replies:
                if not self.background_pull:
                    self.sleep(self.poll_s)
                continue
            for reply in replies:
                got = flights.pop(reply.metadata.reply_to_message_id, None)
                if got is None:
                    continue  # not ours (a reply pulled twice, or to a dropped flight)
                f = got
                staleness = version - f.version
                item = self._screen(reply, f, staleness, period, now, rnd)
                wasted = 0 if item is not None else wasted + 1
                if wasted >= stall:
                    # Without a round budget nothing else ends a fleet whose every reply is
                    # declined or dropped: the loop would re-send models for ever.
                    why = f"the last {wasted} replies were all declined or dropped (see the log)"
                    return self._end(arrays, version, why)
                if item is None:
                    continue
                buffer.append(item)
                if len(buffer) < s.buffer_size:
                    if self.checkpoint is not None:
                        self.checkpoint(version, arrays)  # the buffer survives a stop
                    continue
                # The buffer is full: a new version.
                with in_round(ctx):
                    new, metrics = self._aggregate(version + 1, arrays, buffer, ctx)
                used = buffer if new is not None else []
                buffer = []
                resend.clear()  # a version later, they are idle devices like any other
                if new is None:
                    failed += 1
                    if failed >= MAX_FAILED_BUFFERS:
                        return self._end(arrays, version, f"{failed} buffers in a row could "
                                         "not be aggregated (see the log)")  # fmt: skip
                    continue  # the inner strategy made nothing: keep building this version
                failed = 0
                arrays, version = new, version + 1
                last = version >= num_versions
                result = self._result(version, arrays, used, metrics, period, flights, ctx,
                                      t0, last)  # fmt: skip
                period = _Period()  # (before the callbacks: a checkpoint holds the next's)
                with in_round(ctx):
                    reasons = [r for cb in self.callbacks if (r := cb.after_round(result))]
                final = result.eval_metrics
                if reasons:
                    log(INFO, "Stopping after version %d: %s", version, reasons[0])
                    if not result.evaluated:
                        final = self._evaluate(version, arrays)
                    return LoopOutcome(arrays, version, version, reasons[0], final)
                if last:
                    break
                ctx = self._context(version + 1)
                template = self._template(ctx, version + 1, arrays, train_config)
        return LoopOutcome(arrays, version, None, "budget", final)

    def _end(self, arrays: ArrayRecord, version: int, why: str) -> LoopOutcome:
        log(WARNING, "Asynchronous run ends after version %d: %s", version, why)
        return LoopOutcome(arrays, version, version, why, self._evaluate(version, arrays))

    def _context(self, version: int) -> RoundContext:
        return RoundContext(
            version,
            self.registry,
            online=lambda: set(self.grid.get_node_ids()),
            fleet=self.fleet,
            asynchronous=True,
        )

    def _template(
        self, ctx: RoundContext, version: int, arrays: ArrayRecord, config: ConfigRecord | None
    ) -> Message | None:
        """The inner strategy's train message for ``version`` (its content goes to every
        device this version sends to)."""
        grid = _TemplateGrid(self.grid, _min_nodes(self.strategy))
        with in_round(ctx):
            messages = list(
                self.strategy.configure_train(
                    version,
                    arrays,
                    ConfigRecord(dict(config or {})),
                    grid,  # type: ignore[arg-type]
                )
            )
        return messages[0] if messages else None

    # -- who starts, on the energy slot clock ------------------------------------------------

    def _choose(
        self, ctx: RoundContext, rnd: int, arrays: ArrayRecord, idle: list[int], free: int
    ) -> list[int]:
        """Which of ``idle`` start now (at most ``free``): the strategy's choice
        (``choose_to_start``), its statuses asked on the slot clock's round ``rnd`` and kept
        in the version's context until the clock moves or the device trains."""
        query = self._query
        assert query is not None
        # The loop comes here on every poll while a slot is free. When nobody could start
        # and nothing has changed since (the same idle nodes, slots and clock round), the
        # answer is the same: not asked again (nor the selection's seeded tie order drawn).
        key = (rnd, tuple(idle), free)
        if key == self._nobody_for:
            return []

        def ask(nodes: Sequence[int]) -> Mapping[int, Any]:
            todo = [n for n in nodes if n not in ctx.status and n not in ctx.status_errors]
            if todo:
                query.ask(self.grid, todo, rnd)
                # One that did not answer is not asked again until the clock moves: the loop
                # comes here every poll, and each ask of a silent node waits its timeout.
                for n in todo:
                    if n not in ctx.status:
                        ctx.status_errors.setdefault(n, "no answer to the status query")
            return {n: ctx.status[n] for n in nodes if n in ctx.status}

        with in_round(ctx):
            chosen = self.hooks.choose_to_start(rnd, arrays, idle, free, ask)
        if chosen is None:
            return idle[:free]
        allowed = set(idle)
        start = [n for n in chosen if n in allowed][:free]
        self._nobody_for = None if start else key
        return start

    def _spends(self, ctx: RoundContext, node: int) -> None:
        """``node`` was sent a model to train: what it said of its battery no longer holds."""
        ctx.status.pop(node, None)
        if (device := self.registry.device_of(node)) is not None:
            self.registry.note_energy(device, None)

    def _tick(self, ctx: RoundContext, rnd: int) -> str | None:
        """Nobody trains and no idle device can afford to: the slot clock moves on a round
        (its answers forgotten), or, after ``max_empty`` such rounds in a row, why the run
        ends."""
        self._ticks += 1
        self._empty += 1
        ctx.status.clear()
        ctx.status_errors.clear()
        if self.max_empty and self._empty >= self.max_empty:
            return (
                f"for {self._empty} slot-clock rounds in a row no idle device could afford to "
                f"train and none was training (run.max-empty-rounds = {self.max_empty})"
            )
        log(INFO, "Nobody can afford to train at slot %d: the slot clock moves on to slot %d",
            self.fleet.slot(rnd), self.fleet.slot(rnd + 1))  # fmt: skip
        self.sleep(self.poll_s)
        return None

    # -- screening one reply ----------------------------------------------------------------

    def _drop(self, period: _Period, device: str, reason: str) -> None:
        reason = bound_reason(reason)  # it can quote a reply's text: bounded in log and row
        log(WARNING, "Dropping reply from device %s: %s", device, reason)
        if len(period.rejected) < MAX_REASONS:
            period.rejected.append({"device": device, "reason": reason})
        else:
            period.dropped_more += 1

    def _screen(
        self, msg: Message, f: Flight, staleness: int, period: _Period, now: float, rnd: int
    ) -> Buffered | None:
        """The reply as a buffer entry, or None (declined or dropped, with its reason)."""
        node = f.node
        claimed = claimed_device(msg)
        device = self.registry.name(node, claimed)
        if msg.has_error():
            why = bounded_reason(msg)
            if is_unreachable(msg):
                log(WARNING, "Device %s unreachable: %s", device, why)
                _note_once(period.unreachable, device)
            else:
                log(INFO, "Device %s declined: %s", device, why)
                _note_once(period.declined, device)
            return None
        if self.settings.too_stale(staleness):
            self._drop(period, device, f"staleness {staleness} > async.max-staleness "
                       f"{self.settings.max_staleness}")  # fmt: skip
            return None
        try:
            reason = self._check(msg, f, node, claimed)
        except Exception as err:  # noqa: BLE001 - a reply must never end a run
            reason = f"reply could not be checked: {type(err).__name__}: {err}"
        if reason:
            self._drop(period, device, reason)
            return None
        if claimed is not None:
            self.registry.bind(node, claimed)
            device = claimed
        nbytes = payload_bytes(msg)
        period.bytes_up += nbytes
        metrics = first_metrics(msg)
        compute = None if metrics is None else numbers(metrics).get(TRAIN_TIME)
        self._link(node).observe(now - f.pushed_at, nbytes + f.nbytes, compute)
        if self._query is not None and (energy := energy_after(msg, node, rnd)) is not None:
            self.registry.note_energy(device, energy)  # what it has left (status-max-age)
        period.accepted.append(device)
        period.staleness.append(staleness)
        return Buffered(msg, staleness, f.base, device, f.version)

    def _check(self, msg: Message, f: Flight, node: int, claimed: str | None) -> str | None:
        if not msg.has_content():
            return "the reply has neither content nor an error"
        reason = self.hooks.check_reply(msg, f.base, self.keys)
        if reason:
            return reason
        reason = check_bounds(reply_metrics(msg.content), self.keys, self.screening)
        if reason:
            return reason
        if claimed is not None:
            refused = self.registry.screen(
                {0: (node, claimed)}, lambda: set(self.grid.get_node_ids())
            )
            if refused:
                return refused[0]
        factor = self.screening.norm_factor
        if factor == 0:
            return None
        norm = self.hooks.update_norm(msg, f.content, f.base)
        if not math.isfinite(norm):
            return "update norm is not finite"
        ref = norm_reference([norm], self.norms)
        share = self.screening.norm_floor
        floor = share * model_norm(f.base) if share else 0.0
        if ref is not None and norm > max(factor * ref, floor):
            return (
                f"update norm {norm:.4g} is {norm / ref:.3g} x the median {ref:.4g} of recent "
                f"updates (bound {factor:g} x)"
            )
        self.norms.append(norm)
        return None

    # -- a new version ----------------------------------------------------------------------

    def _aggregate(
        self, version: int, arrays: ArrayRecord, buffer: list[Buffered], ctx: RoundContext
    ) -> tuple[ArrayRecord | None, dict[str, float]]:
        """The next global model from a full buffer (module docstring), or None with the
        reason logged; nothing the inner strategy raises ends the run."""
        try:
            # A submodel reply (CA-HFP) is made full size against the version it was cut
            # from, so its pruned entries carry no update into the rebase.
            shares = self._participation(version, buffer)
            replies = [rebase(self.hooks.full_size_reply(b.msg, b.base), arrays, b.base,
                              self.settings.weight(b.staleness) * share)
                       for b, share in zip(buffer, shares, strict=True)]  # fmt: skip
            replies.sort(
                key=lambda m: device_order(claimed_device(m) or str(m.metadata.src_node_id))
            )
            new, metrics = self.strategy.aggregate_train(
                version, common_metrics(replies, self.keys)
            )
            if new is None:
                log(WARNING, "Version %d not made: the strategy aggregated nothing", version)
                return None, {}
            # Inside the try: a user's strategy that drops or reshapes an array must not end
            # the run here either.
            lr = self.settings.server_lr_at(version, self._num_versions)
            stepped = server_step(arrays, keep_dtypes(new, arrays), lr)
        except Exception as err:  # noqa: BLE001
            log(WARNING, "Version %d not made (buffer dropped): aggregation failed: %s",
                version, bound_reason(f"{type(err).__name__}: {err}"))  # fmt: skip
            return None, {}
        bad = [k for k, a in stepped.items() if a.dtype.kind == "f" and not np.isfinite(a).all()]
        if bad:
            log(WARNING, "Version %d not made: non-finite values in %s", version, bad[:3])
            return None, {}
        return keep_dtypes(ArrayRecord({k: Array(v) for k, v in stepped.items()}), arrays), numbers(
            metrics
        )

    def _participation(self, version: int, buffer: list[Buffered]) -> list[float]:
        """Each buffered update's participation weight (:meth:`AsyncSettings.
        participation_weight`), from the accepted updates counted so far and this
        buffer's."""
        if self.settings.participation == "none":
            return [1.0] * len(buffer)
        here = Counter(b.device for b in buffer)
        online = set(self.grid.get_node_ids())
        present = {d for d, node in self._node_of.items() if node in online}
        devices = len(present | set(here))
        return [self.settings.participation_weight(
                    version, self._updates.get(b.device, 0) + here[b.device], devices,
                    since=self._joined_at(b))
                for b in buffer]  # fmt: skip

    def _joined_at(self, b: Buffered) -> int:
        """The version at which ``b``'s device joined: kept from its first accepted update,
        else when its node was first seen (or, not seen, the version it was sent)."""
        joined = self._joined.get(b.device)
        if joined is None:
            joined = min(self._seen.get(b.msg.metadata.src_node_id, b.version), b.version)
        return joined

    def _result(
        self,
        version: int,
        arrays: ArrayRecord,
        used: list[Buffered],
        metrics: dict[str, float],
        period: _Period,
        flights: dict[str, Flight],
        ctx: RoundContext,
        t0: float,
        last: bool,
    ) -> RoundResult:
        participants = [b.device for b in used]
        for b in used:
            self._joined.setdefault(b.device, self._joined_at(b))
            self._updates[b.device] = self._updates.get(b.device, 0) + 1
            self._node_of[b.device] = b.msg.metadata.src_node_id
            self.registry.note_joined(b.device, self._joined[b.device])
        self.registry.note_round(
            version, participants, period.declined, period.rejected, period.unreachable
        )
        evaluated = self.evaluate_fn is not None and (version % self.evaluate_every == 0 or last)
        eval_metrics = self._evaluate(version, arrays) if evaluated else {}
        shown = {k: v for k, v in eval_metrics.items() if "class" not in k}
        log(INFO, "[VERSION %d] %d updates (staleness %s)%s", version, len(used),
            [b.staleness for b in used], f": {shown}" if shown else "")  # fmt: skip
        dropped = len(period.rejected) + period.dropped_more
        extra: dict[str, object] = {
            "version": version,
            "accepted": len(period.accepted),
            "dropped": dropped,
            **summarise(period.staleness),
            "in_flight": len(flights),
            "server_lr": self.settings.server_lr_at(version, self._num_versions),
        }
        if self._query is not None:  # the energy slot clock when this version was made
            extra["slot"] = self.fleet.slot(version + self._ticks)
        return RoundResult(
            round=version,
            session=ctx.session,
            arrays=arrays,
            participants=participants,
            participant_nodes=[b.msg.metadata.src_node_id for b in used],
            declined=period.declined,
            rejected=period.rejected,
            unreachable=period.unreachable,
            bytes_up=period.bytes_up,
            bytes_down=period.bytes_down,
            energy_spent=sum(numbers(first_metrics(b.msg)).get(ENERGY_SPENT, 0.0) for b in used),
            train_metrics=metrics,
            eval_metrics=eval_metrics,
            wall_s=self.clock() - t0,
            evaluated=evaluated,
            extra=extra,
            context=ctx,
        )

    def _evaluate(self, version: int, arrays: ArrayRecord) -> dict[str, float]:
        if self.evaluate_fn is None:
            return {}
        # The figures alone: per-class counts serve sessions, which async mode refuses.
        res = self.evaluate_fn(version, arrays)
        return dict(res.metrics if isinstance(res, Evaluation) else res)

    def _link(self, node: int) -> LinkEstimate:
        device = self.registry.device_of(node)
        if device is not None:
            return self.registry.timing(device)
        return self._node_links.setdefault(node, LinkEstimate())

    def state_dict(self) -> dict[str, Any]:
        """The device registry, recent update norms and slot order, and (mid-buffer) the
        buffer's replies, the devices in flight and the version's row so far, for a
        checkpoint (module docstring). Arrays stay NumPy arrays: the checkpoint stores them
        in its own arrays, never pickled."""
        version, buffer, flights, period, dispatches = self._live()
        return {
            "registry": self.registry.state_dict(),
            "norms": list(self.norms),
            "started": [[int(n), int(c)] for n, c in self._started.items()],
            "ticks": int(self._ticks),
            "version": int(version),
            "dispatches": int(dispatches),
            "buffer": _encode_buffer(buffer),
            "in_flight": [int(f.node) for f in flights.values()],
            "period": {k: list(v) if isinstance(v, list) else v for k, v in vars(period).items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.registry.load_state_dict(state.get("registry", {}))
        self.norms.clear()
        self.norms.extend(float(n) for n in state.get("norms", []))
        self._started = {int(n): int(c) for n, c in state.get("started", [])}
        # (Absent before the energy slot clock: no round moved on without a version.) A file
        # is data: a clock that went back would make every battery refuse the next message.
        ticks = state.get("ticks", 0)
        if not (isinstance(ticks, int) and not isinstance(ticks, bool) and ticks >= 0):
            raise ValueError(f"ticks = {ticks!r}: the slot clock's extra rounds must be a "
                             "whole number >= 0")  # fmt: skip
        self._ticks = ticks
        self._restored = {}
        if "buffer" in state:  # a checkpoint of this version or later
            entries = _decode_buffer(state["buffer"])
            # A saved buffer is never full (a full one became a version): K or more is not ours.
            if len(entries) >= self.settings.buffer_size:
                raise ValueError(f"{len(entries)} buffered replies > async.buffer-size "
                                 f"{self.settings.buffer_size} - 1 (a saved buffer is never "
                                 "full)")  # fmt: skip
            in_flight = [int(n) for n in state["in_flight"]]
            if len(in_flight) > self.settings.concurrency:
                raise ValueError(f"{len(in_flight)} devices in flight > async.concurrency "
                                 f"{self.settings.concurrency}")  # fmt: skip
            self._restored = {
                "version": int(state["version"]),
                "dispatches": int(state["dispatches"]),
                "buffer": entries,
                "in_flight": in_flight,
                "period": _restored_period(state["period"]),
            }


def _note_once(devices: list[str], device: str) -> None:
    """Add ``device`` to a row's list unless it is there: a device that keeps answering with
    an error while others keep the loop going must not grow the row with repeats."""
    if device not in devices:
        devices.append(device)


def _restored_period(raw: Any) -> _Period:
    """A checkpoint's row so far, each field of its type and bounded as the loop keeps it."""
    kept = dict(raw)

    def names(key: str) -> list[str]:
        return [str(d)[:_MAX_NAME] for d in list(kept.get(key, []))[:_MAX_LISTED]]

    return _Period(
        accepted=names("accepted"),
        declined=names("declined"),
        unreachable=names("unreachable"),
        rejected=[
            {"device": str(r["device"])[:_MAX_NAME], "reason": bound_reason(r["reason"])}
            for r in list(kept.get("rejected", []))[:MAX_REASONS]
        ],
        dropped_more=int(kept.get("dropped_more", 0)),
        staleness=[int(x) for x in list(kept.get("staleness", []))[:_MAX_LISTED]],
        bytes_down=int(kept.get("bytes_down", 0)),
        bytes_up=int(kept.get("bytes_up", 0)),
    )


def _encode_buffer(buffer: Sequence[Buffered]) -> dict[str, Any]:
    """``buffer`` as a state tree of JSON values and NumPy arrays: each reply's records (its
    model, metrics, configs) and each base model once (replies share their version's)."""
    bases: dict[str, dict[str, Any]] = {}
    entries = []
    for b in buffer:
        bases.setdefault(str(b.version), _arrays(b.base))
        records = []
        for name, record in b.msg.content.items():
            if isinstance(record, ArrayRecord):
                records.append([name, "arrays", _arrays(record)])
            elif isinstance(record, MetricRecord):
                records.append([name, "metrics", dict(record)])
            elif isinstance(record, ConfigRecord):
                records.append([name, "config", dict(record)])
        entries.append({
            "device": b.device,
            "staleness": int(b.staleness),
            "version": int(b.version),
            "node": int(b.msg.metadata.src_node_id),
            "records": records,
        })  # fmt: skip
    return {"bases": bases, "entries": entries}


def _arrays(record: ArrayRecord) -> dict[str, Any]:
    keys = list(record.keys())
    return {"keys": keys, "values": [array_values(record[k]) for k in keys]}


def _record(tree: Mapping[str, Any]) -> ArrayRecord:
    keys, values = list(tree["keys"]), list(tree["values"])
    if len(keys) != len(values) or not all(isinstance(v, np.ndarray) for v in values):
        raise ValueError("a buffered model's keys and arrays do not match")
    return ArrayRecord({str(k): Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})


def _decode_buffer(tree: Mapping[str, Any]) -> list[Buffered]:
    """The replies :func:`_encode_buffer` stored, as buffer entries again (each a reply
    from its node, as the grid delivered it)."""
    bases = {int(v): _record(b) for v, b in dict(tree["bases"]).items()}
    out = []
    for e in tree["entries"]:
        content: dict[str, Any] = {}
        for name, kind, value in e["records"]:
            if kind == "arrays":
                content[str(name)] = _record(value)
            elif kind == "metrics":
                content[str(name)] = MetricRecord(dict(value))
            elif kind == "config":
                content[str(name)] = ConfigRecord(dict(value))
            else:
                raise ValueError(f"a buffered reply's record kind {kind!r}")
        sent = Message(RecordDict(), dst_node_id=int(e["node"]), message_type=MessageType.TRAIN)
        reply = Message(RecordDict(content), reply_to=sent)
        version = int(e["version"])
        out.append(Buffered(reply, int(e["staleness"]), bases[version], str(e["device"]), version))
    return out


def rebase(msg: Message, current: ArrayRecord, base: ArrayRecord, weight: float) -> Message:
    """``msg`` with its model replaced by ``current + weight x (model - base)``: its update,
    discounted, applied to the model the buffer is aggregated into (float64 arithmetic, the
    arrays' dtypes kept). The reply's other records are kept as they are."""
    content = msg.content
    name, record = next((n, r) for n, r in content.array_records.items() if n != "kept")
    out = {}
    for key, arr in record.items():
        value = array_values(arr)
        step = np.asarray(value, np.float64) - np.asarray(array_values(base[key]), np.float64)
        moved = np.asarray(array_values(current[key]), np.float64) + weight * step
        if np.issubdtype(value.dtype, np.integer):
            moved = np.rint(moved)
        out[key] = Array(np.asarray(moved, dtype=value.dtype))
    records: dict[str, Any] = {n: r for n, r in content.items() if n != name}
    msg.content = RecordDict({name: ArrayRecord(out), **records})
    return msg


def _numbered(content: RecordDict, dispatch: int, slot: int | None = None) -> RecordDict:
    """``content`` with ``async-dispatch`` = ``dispatch`` (and the energy slot clock's
    ``slot``, when there is one) in its train config (a copy of the config; the arrays are
    shared, not copied)."""
    out: dict[str, Any] = dict(content.items())
    extra: dict[str, int] = (
        {DISPATCH: dispatch} if slot is None else {DISPATCH: dispatch, "slot": slot}
    )
    for name, record in content.config_records.items():
        out[name] = ConfigRecord({**dict(record), **extra})
    return RecordDict(out)


def server_step(current: ArrayRecord, aggregated: ArrayRecord, lr: float) -> dict[str, np.ndarray]:
    """``current + lr x (aggregated - current)``, each array in its own dtype."""
    out = {}
    for key, arr in current.items():
        x = array_values(arr)
        y = array_values(aggregated[key])
        if lr == 1.0:
            out[key] = np.asarray(y, dtype=x.dtype)
            continue
        moved = np.asarray(x, np.float64) + lr * (np.asarray(y, np.float64) - x)
        if np.issubdtype(x.dtype, np.integer):
            moved = np.rint(moved)
        out[key] = np.asarray(moved, dtype=x.dtype)
    return out


class FedBuff(LoopStrategy):
    """Buffered asynchronous aggregation (FedBuff, Nguyen et al. 2022) around your Flower
    strategy: ``FedBuff(FedAvg(), buffer_size=5, concurrency=20).start(grid, arrays,
    num_rounds=100)`` makes 100 global versions asynchronously (module docstring), with
    your own ClientApp unchanged. ``staleness`` is ``"polynomial"`` (``(1+s)^-a``, default
    ``a = 0.5``), ``"constant"`` or ``"hinge"`` (``a``, ``b``); ``server_lr`` scales each
    step (``server_lr_schedule="cosine"``: from ``server_lr`` down to ``server_lr_min`` over
    the run's versions); ``participation="interval"`` also weights each update by its
    device's participation interval (within [1/``participation_cap``, cap]);
    ``max_staleness`` (> 0) drops older updates."""

    def __init__(
        self,
        inner: Strategy,
        *,
        buffer_size: int = 5,
        concurrency: int = 10,
        staleness: str = "polynomial",
        a: float = 0.5,
        b: int = 4,
        server_lr: float = 1.0,
        max_staleness: int = 0,
        server_lr_schedule: str = "constant",
        server_lr_min: float = 0.0,
        participation: str = "none",
        participation_cap: float = 4.0,
    ) -> None:
        super().__init__(inner)
        self.async_settings = AsyncSettings(
            concurrency=concurrency,
            buffer_size=buffer_size,
            staleness=staleness,
            a=a,
            b=b,
            server_lr=server_lr,
            max_staleness=max_staleness,
            server_lr_schedule=server_lr_schedule,
            server_lr_min=server_lr_min,
            participation=participation,
            participation_cap=participation_cap,
        )

    def settings(self) -> dict[str, object]:
        return dict(vars(self.async_settings))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        screening: Screening | None = None,
        poll_s: float | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` contract, asynchronously: ``num_rounds`` counts global
        versions, ``timeout`` bounds one device's training; ``evaluate_fn`` runs on the
        initial model (round 0) and after every version. Federated evaluation is not run
        (``evaluate_config`` is accepted for the signature's sake)."""
        log(INFO, "Starting FedBuff (asynchronous) over %s:", type(self.inner).__name__)
        self.summary()
        result = Result(arrays=initial_arrays)
        central = result.evaluate_metrics_serverapp

        def evaluate(version: int, arrays: ArrayRecord) -> dict[str, float]:
            res = evaluate_fn(version, arrays) if evaluate_fn else None
            if res is None:
                return {}
            central[version] = res
            return numbers(res)

        if evaluate_fn is not None:
            log(INFO, "Initial global evaluation results: %s", evaluate(0, initial_arrays))

        class Collect(RoundCallback):
            def after_round(self, res: RoundResult) -> str | None:
                if res.train_metrics:
                    result.train_metrics_clientapp[res.round] = MetricRecord(
                        dict(res.train_metrics)
                    )
                return None

        loop = AsyncLoop(
            self.inner,
            grid,
            self.async_settings,
            evaluate_fn=evaluate if evaluate_fn is not None else None,
            callbacks=[Collect()],
            screening=screening,
            reply_timeout=timeout,
            poll_s=poll_s,
        )
        outcome = loop.run(initial_arrays, num_rounds, train_config)
        result.arrays = outcome.arrays
        log(INFO, "FedBuff ended after version %d (%s). Final results:", outcome.rounds_run,
            outcome.stop_reason)  # fmt: skip
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result
