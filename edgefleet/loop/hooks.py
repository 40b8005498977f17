"""The calls EdgeFleet's wrappers make on the strategy inside them, with defaults.

A wrapper (sessions, stopping, selection, reconstruction) tells the strategy it wraps about
things Flower's ``Strategy`` has no call for: a session boundary, the devices it has heard
from; it declares what it needs of the fleet (the loop's status phase, the slot clock, the
participant cap) and whom the status phase should ask; and it is asked for state to
checkpoint and for the check its replies must pass. :class:`StrategyHooks` declares those
calls once, each with a default that does the right thing for a strategy that does not care
(Flower's FedAvg, or yours): nothing to announce or declare, no state, the standard reply
check.

EdgeFleet's wrappers and stateful aggregators (``FedSAG``) subclass it; :func:`hooks_of`
gives the default hooks for any other strategy, so the loop calls them on any strategy
without asking what it supports. (Finding one wrapper in a chain, ``base.find_wrapper``,
is for EdgeFleet's ServerApp, a few refusals before round 1, and one round call:
reconstruction hands a robust rule inside it the submodels' masks.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Message, RecordDict

from edgefleet.loop.screening import (
    RecordKeys,
    check_train_reply,
    reply_arrays,
    sent_base,
    update_norm,
)

if TYPE_CHECKING:
    from edgefleet.loop.roundloop import RoundCallback
    from edgefleet.loop.status import Ask, Declaration


class StrategyHooks:
    """Hooks with defaults; override the ones a strategy needs."""

    def round_callbacks(self) -> list[RoundCallback]:
        """Callbacks the round loop must call after every round (innermost first)."""
        return []

    def on_session(self, arrays: ArrayRecord | None) -> None:
        """A session boundary: ``arrays`` is the model the session's training starts from,
        or None while the session's auxiliary rounds run."""

    def declarations(self) -> list[Declaration]:
        """What this strategy (and every one inside it) declares of the fleet and needs of
        the loop's status phase (:mod:`edgefleet.loop.status`)."""
        return []

    def plan_status(
        self, server_round: int, arrays: ArrayRecord, nodes: Sequence[int], ask: Ask
    ) -> None:
        """The status phase's second step: whom of ``nodes`` to ask (``ask(nodes)`` sends
        the query to those not yet answered this round and returns the answers); the
        answers are in the round context. Runs before ``configure_train``."""

    def choose_to_start(
        self, clock_round: int, arrays: ArrayRecord, idle: Sequence[int], count: int, ask: Ask
    ) -> list[int] | None:
        """The asynchronous loop's call when ``count`` slots are free: which of the ``idle``
        nodes start training now (at most ``count``, in order), asking their status with
        ``ask`` on the slot clock's round ``clock_round``; None: no preference (the loop
        starts the longest idle). Only a strategy that declares ``dispatch`` is asked."""
        return None

    def register_devices(self, device_ids: Iterable[str]) -> None:
        """Devices heard from, for a strategy that keeps per-device state."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, for the server checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def check_reply(self, msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None:
        """Why the round loop must drop the train reply ``msg``, or None."""
        return check_train_reply(msg, reference, keys)

    def update_norm(self, msg: Message, sent: RecordDict | None, reference: ArrayRecord) -> float:
        """L2 norm of the update a (screened) train reply carries: its arrays minus the
        model that node was sent (``sent``, the content of its train message; the round's
        global model ``reference`` when that does not fit the reply)."""
        arrays = reply_arrays(msg.content)
        return update_norm(arrays, sent_base(arrays, sent, reference))

    def full_size_reply(self, msg: Message, base: ArrayRecord) -> Message:
        """The asynchronous loop's call before it rebases a (screened) reply onto the newest
        version: the reply with full-size arrays, made against ``base``, the model version
        that device was sent. A strategy whose replies are full size returns it as it is."""
        return msg


_DEFAULTS = StrategyHooks()


def hooks_of(strategy: object) -> StrategyHooks:
    """``strategy``'s hooks: its own if it has them, else the defaults."""
    return strategy if isinstance(strategy, StrategyHooks) else _DEFAULTS
