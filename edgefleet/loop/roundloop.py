"""The one round loop every EdgeFleet strategy runs in, with callbacks.

Flower's ``Strategy.start`` runs a fixed number of rounds and offers no hook between them;
stopping rules, checkpoints and metrics rows would each have to copy it. Here the loop is
written once. Per round it:

0. runs the status phase when a component needs it (:mod:`edgefleet.loop.status`):
   the one status query of the round, on the fleet's one slot clock, answers in the
   registry and the round context;
1. asks the strategy for train messages and sends them with a bounded timeout;
2. screens every reply (:mod:`edgefleet.loop.screening`): on its own (well-formed,
   finite, within the server's bounds, claiming a device id that is its node's), then
   against the round (update norm at most k x the median); a bad one is dropped with its
   reason in the row's ``rejected`` instead of reaching the strategy;
3. lets the strategy aggregate; anything it raises drops the round (model unchanged, reason
   in the row), and a global model that comes out non-finite is rolled back;
4. runs federated evaluation when the strategy configures it (``fraction_evaluate`` > 0),
   and central evaluation every ``evaluate_every`` rounds and on the last;
5. hands a :class:`RoundResult` to each callback in order; any callback may ask to stop (in
   the style of pfl-research's ``after_central_iteration``).

The loop owns the run's :class:`~edgefleet.loop.registry.DeviceRegistry` (which node
speaks for which device, and what each device did) and makes one
:class:`~edgefleet.loop.context.RoundContext` per round, current around every call it
makes into the strategy and the callbacks for that round: wrappers keep what they learn in a
round there. It is the only sender of messages: wrappers build them and declare what they
need of the fleet (the status answers, the slot clock, the participant cap), which the loop
fixes once before round 1 (:class:`~edgefleet.loop.context.FleetFacts`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.bounds import bound_reason
from edgefleet.loop.context import (
    ClassAccuracy,
    RoundContext,
    ScreeningRow,
    in_round,
    round_or_none,
)
from edgefleet.loop.hooks import hooks_of
from edgefleet.loop.registry import (
    DeviceRegistry,
    EnergyState,
    parse_battery,
    parse_feasible,
)
from edgefleet.loop.screening import (
    NORM_HISTORY_ROUNDS,
    RecordKeys,
    Screening,
    array_values,
    check_bounds,
    check_metric_sizes,
    claimed_device,
    common_metrics,
    first_metrics,
    model_norm,
    norm_reference,
    reply_metrics,
)
from edgefleet.loop.status import StatusPhase, StatusQuery, bounded_reason, is_unreachable
from edgefleet.loop.timing import (
    Exchange,
    LinkEstimate,
    RoundWait,
    exchange,
    reported_compute,
)
from edgefleet.wire import (
    BATTERY_LEVEL,
    ENERGY_RECORD,
    ENERGY_SPENT,
    FEASIBLE,
    TRAIN_TIME,
)


@dataclass(frozen=True)
class Evaluation:
    """A central evaluation's figures (``metrics.jsonl`` columns such as ``test_accuracy``)
    and, when the evaluation counts them, each class's correct predictions (read by the
    sessions wrapper, typed rather than spelled into metric names)."""

    metrics: dict[str, float]
    per_class: dict[int, ClassAccuracy] = field(default_factory=dict)


# A central evaluation: its figures, or an Evaluation with the per-class counts too.
EvaluateFn = Callable[[int, ArrayRecord], "dict[str, float] | Evaluation"]


@dataclass
class RoundResult:
    """What happened in one round. ``context`` holds the round's typed row sections (what
    each EdgeFleet component did); a callback of your own may add columns to ``extra``."""

    round: int
    session: int
    arrays: ArrayRecord  # global model after the round
    participants: list[str]  # device ids whose update was aggregated
    declined: list[str]  # devices that answered with an error of their own (a battery decline)
    rejected: list[dict[str, str]]  # {"device": ..., "reason": ...} for dropped replies
    bytes_up: int
    bytes_down: int
    energy_spent: float
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float]  # central evaluation ({} in a round without one)
    wall_s: float  # seconds since the loop started
    participant_nodes: list[int] = field(default_factory=list)  # their Flower node ids
    federated_metrics: dict[str, float] = field(default_factory=dict)  # ClientApps' evaluation
    evaluated: bool = True  # whether central evaluation ran this round
    extra: dict[str, object] = field(default_factory=dict)
    context: RoundContext = field(default_factory=lambda: RoundContext(0, DeviceRegistry()))
    # each class's counts in this round's central evaluation ({}: none, or not counted)
    per_class: dict[int, ClassAccuracy] = field(default_factory=dict)
    # devices the transport could not reach (Flower's "Node Unavailable" for a SuperNode
    # that stopped heartbeating, a message or reply lost): gone, not a device's decision
    unreachable: list[str] = field(default_factory=list)


class RoundCallback:
    """Base class of round callbacks; override what you need."""

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        """Called once before the first round with the model the loop starts from."""

    def after_round(self, result: RoundResult) -> str | None:
        """Called after each round; return a stop reason to end the run, else None."""
        return None

    def on_end(self, arrays: ArrayRecord, last_round: int) -> None:
        """Called once when the run ends (budget used or stopped) with its final model: what
        must outlive the run (the warm-start store's open session) is kept here."""


class NotEnoughNodes(RuntimeError):
    """A strategy waited longer than the loop allows for nodes that are not online."""


class BoundedGrid:
    """The grid as the loop hands it to the strategy: waiting for nodes is bounded.

    Flower's FedAvg family samples nodes with a loop that sleeps until ``min_available_nodes``
    (or ``min_train_nodes``, ``min_evaluate_nodes``, default 2) are online, without a
    timeout: a fleet one node short hangs the server for good. Here a strategy that keeps
    asking for the node list for longer than ``timeout`` seconds within one ``configure_*``
    call gets :class:`NotEnoughNodes`, and the loop skips that phase of the round.
    """

    def __init__(self, grid: Grid, timeout: float) -> None:
        self._grid, self.timeout = grid, timeout
        self._since: float | None = None

    def restart(self) -> None:
        self._since = None

    def get_node_ids(self) -> list[int]:
        nodes = list(self._grid.get_node_ids())
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since > self.timeout:
            raise NotEnoughNodes(
                f"the strategy has waited {now - self._since:.0f} s for more nodes than the "
                f"{len(nodes)} online (check its min_*_nodes settings)"
            )
        return nodes

    def online(self) -> set[int]:
        """The nodes online now (no waiting involved)."""
        return set(self._grid.get_node_ids())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class ReplyCheck(Protocol):
    def __call__(self, msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None: ...


@dataclass(frozen=True)
class LoopOutcome:
    arrays: ArrayRecord
    rounds_run: int
    stop_round: int | None  # round at which a callback stopped the run; None = budget used
    stop_reason: str  # "budget" or the callback's reason
    final_eval: dict[str, float] = field(default_factory=dict)  # central figures of `arrays`


class RoundLoop:
    """Drive ``strategy`` for up to ``num_rounds`` rounds over ``grid``.

    ``evaluate_fn`` evaluates the global model on data the server holds (None: no central
    evaluation); ``evaluate_every`` = N runs it every N rounds and always on the last round
    (and on the model a stopped run ends with). ``evaluate_config`` goes to the strategy's
    ``configure_evaluate`` (federated evaluation, when its ``fraction_evaluate`` > 0).
    ``screening`` bounds what one reply may do (:class:`~edgefleet.loop.screening.
    Screening`; the defaults know nothing of the ClientApp). :meth:`state_dict` holds the
    run's device bindings and recent update norms, for a checkpoint.
    """

    def __init__(
        self,
        strategy: Strategy,
        grid: Grid,
        *,
        evaluate_fn: EvaluateFn | None = None,
        evaluate_every: int = 1,
        evaluate_config: ConfigRecord | None = None,
        callbacks: Sequence[RoundCallback] = (),
        round_timeout: float = 600.0,
        node_wait_timeout: float = 60.0,
        screening: Screening | None = None,
        wait: RoundWait | None = None,
    ) -> None:
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every={evaluate_every!r} must be >= 1")
        self.strategy = strategy
        self.grid = BoundedGrid(grid, node_wait_timeout)
        self.evaluate_fn = evaluate_fn
        self.evaluate_every = evaluate_every
        self.evaluate_config = evaluate_config
        self.callbacks = list(callbacks)
        # How long a round waits for each reply (:mod:`edgefleet.loop.timing`); without
        # one, ``round_timeout`` for every reply.
        self.wait = wait or RoundWait(round_timeout=round_timeout)
        # Timing of nodes with no device record (a ClientApp that claims no device-id, as a
        # Flower user's may not): by node id, for this process only (node ids change).
        self._node_links: dict[int, LinkEstimate] = {}
        self.keys = RecordKeys.of(strategy)
        # A strategy that accepts other replies than full-size arrays (CA-HFP's compact
        # submodels) brings its own check.
        self.check: ReplyCheck = hooks_of(strategy).check_reply
        self.screening = screening or Screening()
        self.registry = DeviceRegistry(self.screening.device_binding)
        # What the components declare of the fleet, merged once: two clocks are refused here.
        self.status = StatusPhase(strategy, hooks_of(strategy).declarations())
        self.fleet = self.status.fleet
        # Update norms accepted in recent rounds: the reference of a round with few replies.
        self.norm_history: deque[list[float]] = deque(maxlen=NORM_HISTORY_ROUNDS)
        self._last_eval: tuple[ArrayRecord, Evaluation] | None = None

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
        result: RoundResult | None = None
        for rnd in range(first_round, num_rounds + 1):
            with in_round(self.new_context(rnd)):
                result = self.run_round(
                    rnd, arrays, ConfigRecord(dict(train_config or {})), t0, rnd == num_rounds
                )
                arrays = result.arrays
                # Every callback sees every round (the metrics row must be written even when
                # an earlier callback asks to stop); the first reason given wins.
                reasons = [r for cb in self.callbacks if (r := cb.after_round(result))]
            if reasons:
                log(INFO, "Stopping after round %d: %s", rnd, reasons[0])
                final = result.eval_metrics if result.evaluated else self.evaluate(rnd, arrays)
                self._end(arrays, rnd)
                return LoopOutcome(arrays, rnd, rnd, reasons[0], final)
        final = result.eval_metrics if result is not None else {}
        self._end(arrays, num_rounds)
        return LoopOutcome(arrays, num_rounds, None, "budget", final)

    def _end(self, arrays: ArrayRecord, last_round: int) -> None:
        for callback in self.callbacks:
            # A callback written against the older protocol (after_round only) has none.
            end = getattr(callback, "on_end", None)
            if end is not None:
                end(arrays, last_round)

    def evaluate(self, rnd: int, arrays: ArrayRecord) -> dict[str, float]:
        """Central evaluation of ``arrays``. A round that aggregated nothing keeps the very
        record it was given: its figures are the last evaluation's, not a second pass over
        the test set (under scarce energy, many rounds have no participant)."""
        if self.evaluate_fn is None:
            return {}
        if self._last_eval is not None and self._last_eval[0] is arrays:
            return dict(self._last_eval[1].metrics)
        res = self.evaluate_fn(rnd, arrays)
        done = res if isinstance(res, Evaluation) else Evaluation(dict(res))
        self._last_eval = (arrays, done)
        return dict(done.metrics)

    def _per_class(self, arrays: ArrayRecord) -> dict[int, ClassAccuracy]:
        """The per-class counts of the evaluation of ``arrays`` ({} if it had none)."""
        last = self._last_eval
        return dict(last[1].per_class) if last is not None and last[0] is arrays else {}

    def new_context(self, rnd: int) -> RoundContext:
        return RoundContext(rnd, self.registry, online=self.grid.online, fleet=self.fleet)

    def census(self, first_round: int, timeout: float, first_timeout: float | None) -> None:
        """One status query to every online node before ``first_round`` (the ServerApp's
        fleet check, ``edgefleet.server.app.fleet_census``), on the fleet's clock: the
        answers land in the registry. Sent here so that the loop stays the only sender."""
        query = StatusQuery(self.fleet.slots_per_round, timeout, first_timeout)
        with in_round(self.new_context(first_round)):
            query.ask(self.grid, sorted(self.grid.online()), first_round)  # type: ignore[arg-type]

    def run_round(
        self, rnd: int, arrays: ArrayRecord, config: ConfigRecord, t0: float, last: bool = False
    ) -> RoundResult:
        """One round, in the context :meth:`run` made current (a new one when called on its
        own); the callbacks are :meth:`run`'s business."""
        ctx = round_or_none()
        if ctx is None or ctx.round != rnd:
            with in_round(self.new_context(rnd)):
                return self.run_round(rnd, arrays, config, t0, last)
        log(INFO, "[ROUND %d]", rnd)
        self.grid.restart()
        try:
            self.status.run(self.grid, rnd, arrays)  # type: ignore[arg-type]
        except NotEnoughNodes as err:  # a strategy's own wait for nodes, bounded
            log(WARNING, "Round %d: %s: status phase skipped", rnd, err)
        messages = self._configure(self.strategy.configure_train, rnd, arrays, config)
        bytes_down = sum(payload_bytes(m) for m in messages)
        sent_round = self._exchange(messages, ctx)
        replies = sent_round.replies
        # A reply is the answer to the message its reply_to names: the SuperLink's own error
        # for a node that went away comes from the SuperLink, not from that node.
        asked: dict[str, int] = ctx.own(self, dict)
        asked.update((m.metadata.message_id, m.metadata.dst_node_id) for m in messages)
        asked.pop("", None)  # a message no grid has pushed has no id to answer to
        row = ctx.section(ScreeningRow)
        if len(replies) < len(messages):
            replied = {self.node_of(r) for r in replies}
            missing = sorted(
                (self.registry.name(m.metadata.dst_node_id) for m in messages
                 if m.metadata.dst_node_id not in replied), key=device_order,
            )  # fmt: skip
            log(WARNING, "Round %d: %d of %d replies; no reply from %s", rnd, len(replies),
                len(messages), ", ".join(missing))  # fmt: skip
            row.missing = missing
        sent = {m.metadata.dst_node_id: m.content for m in messages if m.has_content()}
        accepted, declined, rejected, unreachable = self._screen(replies, arrays, sent, row)
        # Counted before aggregation: Flower's FedMedian, FedTrimmedAvg and Bulyan empty the
        # replies' ArrayRecords while they aggregate.
        bytes_up = sum(payload_bytes(m) for m in accepted)
        self._note_timing(sent_round, accepted)
        self._note_energy(rnd, messages, replies)
        new_arrays, train_metrics = self._aggregate(rnd, accepted, arrays, row)
        aggregated = accepted if new_arrays is not None else []
        if new_arrays is not None:
            arrays = new_arrays
        if not aggregated:
            why = self._why_empty(len(messages), len(replies), len(accepted), row)
            row.no_participants = row.no_participants or why
        participants = [self.device_of(m) for m in aggregated]
        self.registry.note_round(rnd, participants, declined, rejected, unreachable)
        federated = self._evaluate_federated(rnd, arrays)
        evaluated = self.evaluate_fn is not None and (rnd % self.evaluate_every == 0 or last)
        eval_metrics = self.evaluate(rnd, arrays) if evaluated else {}
        shown = {**eval_metrics, **federated}
        if shown:
            log(INFO, "Round %d: %s", rnd, shown)
        return RoundResult(
            round=rnd,
            session=ctx.session,
            arrays=arrays,
            participants=participants,
            participant_nodes=[m.metadata.src_node_id for m in aggregated],
            declined=declined,
            unreachable=unreachable,
            rejected=rejected,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            energy_spent=sum(_metric(m, ENERGY_SPENT) for m in accepted),
            train_metrics=train_metrics,
            eval_metrics=eval_metrics,
            federated_metrics=federated,
            evaluated=evaluated,
            per_class=self._per_class(arrays) if evaluated else {},
            wall_s=time.monotonic() - t0,
            context=ctx,
        )

    def _exchange(self, messages: list[Message], ctx: RoundContext) -> Exchange:
        """Send the round's train messages, each with its wait (:class:`RoundWait`)."""
        waits = [self.wait.budget(self.link_of(m.metadata.dst_node_id)) for m in messages]
        if self.wait.mode != "fixed" and waits:
            ctx.section(ScreeningRow).round_wait_s = round(max(waits), 3)
        return exchange(self.grid, messages, waits)  # type: ignore[arg-type]

    def link_of(self, node: int) -> LinkEstimate | None:
        """What the loop has timed of ``node``'s rounds: its device's estimate in the
        registry, else the node's own (None: never timed)."""
        device = self.registry.device_of(node)
        if device is not None:
            return self.registry.link(device)
        return self._node_links.get(node)

    def _link_for(self, node: int) -> LinkEstimate:
        """``node``'s estimate to add to (made on first use)."""
        device = self.registry.device_of(node)
        if device is not None:
            return self.registry.timing(device)
        return self._node_links.setdefault(node, LinkEstimate())

    def _note_timing(self, sent: Exchange, accepted: list[Message]) -> None:
        """Each accepted reply's time into its device's link estimate; a message nobody
        answered raises its device's estimate to the wait it was given."""
        for msg in accepted:
            rid = msg.metadata.reply_to_message_id
            if rid not in sent.arrived_s:
                continue
            metrics = first_metrics(msg)
            compute = None if metrics is None else reported_compute(metrics.get(TRAIN_TIME))
            nbytes = payload_bytes(msg) + payload_bytes(sent.pushed.get(rid))
            link = self._link_for(msg.metadata.src_node_id)
            link.observe(sent.arrived_s[rid], nbytes, compute)
        for rid, msg in sent.pushed.items():
            if rid not in sent.arrived_s:
                self._link_for(msg.metadata.dst_node_id).timed_out(sent.waits[rid])

    def _note_energy(self, rnd: int, messages: list[Message], replies: list[Message]) -> None:
        """What each device's energy is after this round. A device sent a train message may
        have spent energy, so what it said before is forgotten; a reply with an ``energy``
        record (``battery-level``, ``feasible``: the energy mod adds it) says it afresh."""
        for msg in messages:
            if (device := self.registry.device_of(msg.metadata.dst_node_id)) is not None:
                self.registry.note_energy(device, None)
        for reply in replies:
            node = self.node_of(reply)
            state = energy_after(reply, node, rnd)
            if state is not None and (device := self.registry.device_of(node)) is not None:
                self.registry.note_energy(device, state)

    def _why_empty(self, sent: int, replies: int, accepted: int, row: ScreeningRow) -> str:
        """Why a round aggregated nobody (a wrapper that chose nobody says more itself)."""
        if not sent:
            return "the strategy sent no train messages"
        if row.round_dropped:
            why = row.round_dropped
        elif not replies:
            why = f"no reply to {sent} train messages within {self.wait.round_timeout:.0f} s"
        elif not accepted:
            why = f"none of the {replies} replies was usable (declined or rejected)"
        else:
            why = f"the strategy aggregated none of the {accepted} accepted replies"
        log(WARNING, "No participants: %s", why)
        return why

    def _configure(
        self,
        configure: Callable[[int, ArrayRecord, ConfigRecord, Grid], Iterable[Message]],
        rnd: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
    ) -> list[Message]:
        self.grid.restart()
        try:
            return list(configure(rnd, arrays, config, self.grid))  # type: ignore[arg-type]
        except NotEnoughNodes as err:
            log(WARNING, "Round %d: %s: %s skipped", rnd, err, configure.__name__)
            return []

    def _aggregate(
        self, rnd: int, accepted: list[Message], arrays: ArrayRecord, row: ScreeningRow
    ) -> tuple[ArrayRecord | None, dict[str, float]]:
        """The strategy's new global model (None: unchanged) and its train metrics. Nothing
        the strategy raises ends the run, and a non-finite model never becomes global."""
        try:
            new, metrics = self.strategy.aggregate_train(rnd, accepted)
        except Exception as err:  # noqa: BLE001 - a device's reply must never end a run
            # bounded: an error's message may quote what a reply held
            reason = bound_reason(f"aggregation failed: {type(err).__name__}: {err}")
            log(WARNING, "Round %d dropped (model unchanged): %s", rnd, reason)
            row.round_dropped = reason
            return None, {}
        out = numbers(metrics)
        if new is None:
            return None, out
        new = keep_dtypes(new, arrays)
        bad = [k for k, a in new.items() if not _finite(a)]
        if bad:
            reason = f"aggregated model has non-finite values in {bad[:3]}: rolled back"
            log(WARNING, "Round %d: %s", rnd, reason)
            row.round_dropped = reason
            return None, out
        return new, out

    def _evaluate_federated(self, rnd: int, arrays: ArrayRecord) -> dict[str, float]:
        config = ConfigRecord(dict(self.evaluate_config or {}))
        messages = self._configure(self.strategy.configure_evaluate, rnd, arrays, config)
        if not messages:
            return {}
        replies = self.grid.send_and_receive(messages, timeout=self.wait.round_timeout)
        good = []
        for msg in replies:
            if msg.has_error() or not msg.has_content():
                continue
            records = msg.content.metric_records
            weight = (
                numbers(reply_metrics(msg.content)).get(self.keys.weight, 0.0) if records else 0
            )
            if len(records) != 1 or not weight > 0:
                log(WARNING, "Dropping evaluation reply from %s", self.device_of(msg))
                continue
            # its keys would be kept in the row's federated metrics
            too_big = check_metric_sizes(reply_metrics(msg.content))
            if too_big:
                log(WARNING, "Dropping evaluation reply from %s: %s", self.device_of(msg), too_big)
                continue
            good.append(msg)
        if not good:
            return {}
        try:
            metrics = self.strategy.aggregate_evaluate(rnd, common_metrics(good, self.keys))
        except Exception as err:  # noqa: BLE001
            log(WARNING, "Round %d: federated evaluation not aggregated: %s", rnd,
                bound_reason(f"{type(err).__name__}: {err}"))  # fmt: skip
            return {}
        return numbers(metrics)

    def node_of(self, msg: Message) -> int:
        """The node a reply answers for: the one its message was sent to (a reply to this
        round's train messages), else its sender."""
        ctx = round_or_none()
        asked: dict[str, int] = ctx.own(self, dict) if ctx is not None else {}
        return asked.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)

    def device_of(self, msg: Message) -> str:
        """The device id a reply speaks for: the id bound to its node (the first it claimed
        in an accepted reply or status answer), else the ``device-id`` it claims, else
        ``node-<node id>``."""
        return self.registry.name(self.node_of(msg), claimed_device(msg))

    def _screen(
        self,
        replies: Iterable[Message],
        reference: ArrayRecord,
        sent: Mapping[int, Any],
        row: ScreeningRow,
    ) -> tuple[list[Message], list[str], list[dict[str, str]], list[str]]:
        """Accepted (in device order, metrics made consistent), declined, rejected and
        unreachable replies. Nothing a reply holds can raise out of here."""
        declined: list[str] = []
        unreachable: list[str] = []
        rejected: list[dict[str, str]] = []

        def reject(msg: Message, reason: str, device: str | None = None) -> None:
            device = device or self.device_of(msg)
            reason = bound_reason(reason)  # the row, the log and the registry keep it
            log(WARNING, "Dropping reply from device %s: %s", device, reason)
            rejected.append({"device": device, "reason": reason})

        candidates: list[Message] = []
        for msg in replies:
            if msg.has_error():
                why = bounded_reason(msg)
                if is_unreachable(msg):
                    log(WARNING, "Device %s unreachable: %s", self.device_of(msg), why)
                    unreachable.append(self.device_of(msg))
                else:
                    log(INFO, "Device %s declined: %s", self.device_of(msg), why)
                    declined.append(self.device_of(msg))
                continue
            try:
                reason = self._check_one(msg, reference)
            except Exception as err:  # noqa: BLE001 - a reply must never end a run
                reason = f"reply could not be checked: {type(err).__name__}: {err}"
            if reason:
                reject(msg, reason)
            else:
                candidates.append(msg)

        # Device ids: a node speaks for the device it first claimed, and no other node may.
        claims = {
            i: (m.metadata.src_node_id, device)
            for i, m in enumerate(candidates)
            if (device := claimed_device(m)) is not None
        }
        reasons = self.registry.screen(claims, self.grid.online)
        for i, reason in sorted(reasons.items()):
            # Its claim is refused: it is known by the node (or the device that node is bound to).
            reject(candidates[i], reason, self.registry.name(candidates[i].metadata.src_node_id))
        candidates = [m for i, m in enumerate(candidates) if i not in reasons]

        candidates = self._screen_norms(candidates, reference, sent, reject, row)
        for msg in candidates:
            device = claimed_device(msg)
            if device is not None:
                self.registry.bind(msg.metadata.src_node_id, device)
        # Replies arrive in whatever order the devices finish; float sums depend on the
        # order, so aggregate in device order to make a seeded run repeatable.
        candidates.sort(key=lambda m: device_order(self.device_of(m)))
        return common_metrics(candidates, self.keys), declined, rejected, unreachable

    def _check_one(self, msg: Message, reference: ArrayRecord) -> str | None:
        if not msg.has_content():
            return "the reply has neither content nor an error"
        reason = self.check(msg, reference, self.keys)
        if reason:
            return reason
        return check_bounds(reply_metrics(msg.content), self.keys, self.screening)

    def _screen_norms(
        self,
        candidates: list[Message],
        reference: ArrayRecord,
        sent: Mapping[int, Any],
        reject: Callable[[Message, str], None],
        row: ScreeningRow,
    ) -> list[Message]:
        """Drop replies whose update norm is not finite, or above both k x the round's median
        and the floor (a share of the global model's norm)."""
        factor = self.screening.norm_factor
        if factor == 0 or not candidates:
            return candidates
        hooks = hooks_of(self.strategy)
        norms: list[float] = []
        kept: list[Message] = []
        for msg in candidates:
            try:
                norm = hooks.update_norm(msg, sent.get(msg.metadata.src_node_id), reference)
            except Exception as err:  # noqa: BLE001
                reject(msg, f"update norm could not be taken: {type(err).__name__}: {err}")
                continue
            if not math.isfinite(norm):
                reject(msg, "update norm is not finite")
                continue
            norms.append(norm)
            kept.append(msg)
        ctx = round_or_none()
        if ctx is not None:
            ctx.update_norms = {self.device_of(m): n for m, n in zip(kept, norms, strict=True)}
        history = [n for past in self.norm_history for n in past]
        ref = norm_reference(norms, history)
        if ref is None:
            if kept:
                log(INFO, "Update-norm bound not applied: fewer than 3 norms known yet")
            self.norm_history.append(norms)
            return kept
        share = self.screening.norm_floor
        floor = share * model_norm(reference) if share else 0.0
        above_floor = f" and above the floor {floor:.4g} ({share:g} x the model's norm)"
        out, accepted_norms = [], []
        for msg, norm in zip(kept, norms, strict=True):
            if norm > max(factor * ref, floor):
                reject(
                    msg,
                    f"update norm {norm:.4g} is {norm / ref:.3g} x the round's median "
                    f"{ref:.4g} (bound {factor:g} x){above_floor if share else ''}",
                )
                continue
            out.append(msg)
            accepted_norms.append(norm)
        self.norm_history.append(accepted_norms)
        row.update_norm_median = round(ref, 6)
        if accepted_norms:
            row.update_norm_max_ratio = round(max(accepted_norms) / ref, 4)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The run's device registry and recent update norms (for the server checkpoint)."""
        return {
            "registry": self.registry.state_dict(),
            "norm_history": [list(r) for r in self.norm_history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.registry.load_state_dict(state.get("registry", {}))
        self.norm_history.clear()
        for norms in state.get("norm_history", []):
            self.norm_history.append([float(n) for n in norms])


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


def _finite(arr: Array) -> bool:
    """Whether a floating-point array's values are all finite (any other array is)."""
    value = array_values(arr)
    return value.dtype.kind != "f" or bool(np.isfinite(value).all())


def numbers(record: Mapping[str, object] | None) -> dict[str, float]:
    """The finite numeric entries of a metric record, as floats (lists and the rest left out)."""
    return {
        k: float(v)
        for k, v in (record or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def energy_after(reply: Message, node: int, rnd: int) -> EnergyState | None:
    """What a train reply's ``energy`` record (the energy mod's, after the device paid for
    its training) says of ``node``'s battery in round ``rnd``; None without a well-formed one."""
    record = None if reply.has_error() else reply.content.get(ENERGY_RECORD)
    if not isinstance(record, ConfigRecord):
        return None
    feasible = parse_feasible(record.get(FEASIBLE))
    if feasible is None:
        return None
    return EnergyState(rnd, feasible, parse_battery(node, record.get(BATTERY_LEVEL)))


def device_order(device: str) -> tuple[int, int | str]:
    """Sort key of device ids: numbers in numeric order, then other names (aggregation runs
    in this order, so a seeded run is repeatable)."""
    return (0, int(device)) if device.isdigit() else (1, device)


def payload_bytes(msg: Message | None) -> int:
    if msg is None or msg.has_error() or not msg.has_content():
        return 0
    return sum(rec.count_bytes() for rec in msg.content.array_records.values())


def _metric(msg: Message, key: str) -> float:
    """A numeric metric of a screened reply (0 when absent or not a finite number)."""
    metrics = first_metrics(msg)
    return 0.0 if metrics is None else numbers(metrics).get(key, 0.0)
