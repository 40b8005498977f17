"""The round context: what one round learns, handed to every wrapper; a wrapper keeps its
round state here, not on itself.

Flower's ``Strategy`` calls (``configure_train``, ``aggregate_train``, ...) carry no state
between them, so a wrapper that learns something in ``configure_train`` (whom it selected,
the model it sent) and needs it in ``aggregate_train`` or in its after-round callback would
have to keep it on itself, where a second run on the same object (or a change in another
wrapper) silently overwrites it. Instead :class:`~edgefleet.loop.roundloop.RoundLoop` makes
one :class:`RoundContext` per round and makes it current (:func:`current_round`) around
every call it makes into the strategy for that round; the round's
:class:`~edgefleet.loop.roundloop.RoundResult` carries it to the callbacks.

A wrapper keeps what it learns in the context:

- a typed *row section* (a dataclass below, one per component) whose fields become the
  round's ``metrics.jsonl`` columns, under the names they have always had;
- its private per-round objects (:meth:`RoundContext.own`), which never reach the row;
- the round's status answers (:attr:`RoundContext.status`), asked once by the loop's status
  phase (:mod:`edgefleet.loop.status`) and read by every wrapper;
- the fleet's facts (:class:`FleetFacts`: the energy slot clock, the participant cap),
  declared once per run by the components and fixed by the loop before round 1.

What lasts longer than a round (ages, memories, the session tracker) is the wrapper's run
state, kept on it and checkpointed with ``state_dict``; which device is which lives in the
run's :class:`~edgefleet.loop.registry.DeviceRegistry`, reachable as
``context.registry``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flwr.app import ArrayRecord

from edgefleet.loop.registry import DeviceRegistry, DeviceStatus

S = TypeVar("S")
T = TypeVar("T")

# A field with this metadata is left out of the row while it is None (the column appears
# only in the rounds that have it, as a session's ``arrived`` or the stopping rule's
# ``validation_loss``); every other field is written in every round that has the section.
OPTIONAL = {"optional": True}


def optional(default: Any = None) -> Any:
    return field(default=default, metadata=OPTIONAL)


def columns(section: object) -> dict[str, Any]:
    """A row section's ``metrics.jsonl`` columns."""
    out = {}
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        if value is None and f.metadata.get("optional"):
            continue
        out[f.name] = value
    return out


# -- the row sections ------------------------------------------------------------------------


@dataclass
class ScreeningRow:
    """The round loop's own columns: why a round was dropped or had nobody, the reference
    of the update-norm bound, and the nodes sent a train message that never replied."""

    round_dropped: str | None = optional()
    no_participants: str | None = optional()
    update_norm_median: float | None = optional()
    update_norm_max_ratio: float | None = optional()
    missing: list[str] | None = optional()  # asked to train, no reply within the timeout
    status_refused: list[dict[str, str]] | None = optional()  # status answers not accepted
    # the longest wait a train message had (server.timeout-mode = expected only)
    round_wait_s: float | None = optional()


@dataclass
class TelemetryRow:
    """Device telemetry the status screening dropped this round (field -> answers), the
    reasons in the log and in ``fleet.json``; only in rounds that dropped some."""

    telemetry_dropped: dict[str, int] = field(default_factory=dict)


@dataclass
class SelectionRow:
    """Energy-aware age-based selection."""

    status_queries: int = 0  # status messages sent this round
    # devices taken as feasible from an earlier answer instead of asked (status-max-age)
    status_reused: int | None = optional()
    selected: list[str] = field(default_factory=list)  # device ids, in selection order
    # devices left out because their observed round exceeds selection.deadline
    deadline_skipped: list[str] | None = optional()
    # slow devices selected again after selection.deadline-retry skipped rounds (re-timed)
    deadline_retried: list[str] | None = optional()


@dataclass
class SessionRow:
    """Sessions and warm start."""

    present: int = 0  # devices present this round
    phase: str = "train"  # "aux" in a session's auxiliary rounds
    presence_queries: int = 0
    arrived: list[str] | None = optional()  # at a session's first round
    left: list[str] | None = optional()
    lr: float | None = optional()  # the client learning rate this round's messages carried
    warmstart_weights: dict[str, float] | list[Any] | None = optional()
    warm_start: bool | None = optional()  # this row's model is a session's warm start
    teacher_downloads: int | None = optional()
    session_classes: list[int] = field(default_factory=list)
    session_accuracy: float | None = None  # central accuracy on the session's classes


@dataclass
class PruningRow:
    """CA-HFP reconstruction."""

    compact_downloads: int = 0
    compact_replies: int | None = optional()
    mean_kept_fraction: float | None = optional()


@dataclass
class RobustRow:
    """Robust aggregation (:mod:`edgefleet.strategies.robust`) and FedSAG's memory expiry."""

    robust_rule: str | None = optional()
    # Coordinates kept by fewer replies than the rule needs: the mean of those that kept them.
    robust_fallback: int | None = optional()
    robust_selected: list[str] | None = optional()  # multikrum: the device ids chosen
    robust_clipped: int | None = optional()  # centered-clip: replies clipped (last iteration)
    saga_expired: list[str] | None = optional()  # memories older than saga.max-age, dropped


@dataclass
class StoppingRow:
    """Data-free stopping (the task vector)."""

    stopping_resting: bool | None = optional()  # the rule rests the devices (sessions)
    task_vector_norm: float | None = optional()
    task_vector_growth: float | None = None  # None: not measured (first or idle round)
    plateau_count: int | None = optional()


@dataclass
class ValidationRow:
    """The validation-stopping baseline."""

    validation_accuracy: float | None = None
    validation_loss: float | None = optional()
    validation_balanced_accuracy: float | None = optional()


# -- the fleet's facts -------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetFacts:
    """What belongs to the fleet, not to a wrapper: one per run, made by the loop from every
    component's declaration (:class:`~edgefleet.loop.status.Declaration`), so that two
    wrappers can never run two clocks.

    ``slots_per_round``: the energy slot clock; round r's status queries and train messages
    carry slot ``(r - 1) * slots_per_round``, and a device's battery only moves forward on
    it. ``participant_cap``: the most devices a round may train (energy-age selection's M),
    which FedSAG weighs its corrections by (None: no cap)."""

    slots_per_round: int = 1
    participant_cap: int | None = None

    def slot(self, server_round: int) -> int:
        return (server_round - 1) * self.slots_per_round


@dataclass(frozen=True)
class ClassAccuracy:
    """Central evaluation's correct predictions and test examples of one class (the sessions
    wrapper's accuracy on the classes present). Counts; floats, so that a weighted
    evaluation fits too."""

    correct: float
    total: float


# -- the context -----------------------------------------------------------------------------


@dataclass
class RoundContext:
    """One round's shared state (see the module docstring)."""

    round: int
    registry: DeviceRegistry
    online: Callable[[], set[int]] = set  # the nodes online now (no waiting)
    session: int = 0
    status: dict[int, DeviceStatus] = field(default_factory=dict)  # this round's answers
    # nodes that answered this round's status query with an error -> its (bounded) reason:
    # unknown this round, not departed
    status_errors: dict[int, str] = field(default_factory=dict)
    fleet: FleetFacts = field(default_factory=FleetFacts)  # the run's clock and cap
    # made by the asynchronous loop: a version being built, whose train messages the loop
    # addresses one device at a time (no status phase, no plan made before configure_train)
    asynchronous: bool = False
    # the model this round's train messages carry when a wrapper replaces the loop's (a
    # session's start, or its auxiliary rounds' pilot model): set by the sessions wrapper
    start_from: ArrayRecord | None = None
    # the model the loop had when this session opened (the last session's final model), named
    # by the sessions wrapper every round: the continuous mode's teacher
    last_session_model: ArrayRecord | None = None
    # the update norms of the replies that reached the norm bound, by device (not a column:
    # benchmarks/claims/norm_ratios.py reads them from the round's result)
    update_norms: dict[str, float] = field(default_factory=dict)
    _sections: dict[type, Any] = field(default_factory=dict)
    _own: dict[int, Any] = field(default_factory=dict)

    @property
    def slot(self) -> int:
        """This round's slot on the fleet's energy clock."""
        return self.fleet.slot(self.round)

    @property
    def participant_cap(self) -> int | None:
        """The most devices this round may train (the fleet's cap), or None."""
        return self.fleet.participant_cap

    def section(self, cls: type[S]) -> S:
        """This round's section of type ``cls`` (made on first use)."""
        if cls not in self._sections:
            self._sections[cls] = cls()
        return self._sections[cls]

    def find(self, cls: type[S]) -> S | None:
        """This round's section of type ``cls``, or None when no component wrote one."""
        return self._sections.get(cls)

    def own(self, owner: object, factory: Callable[[], T]) -> T:
        """``owner``'s private per-round object (made by ``factory`` on first use)."""
        key = id(owner)
        if key not in self._own:
            self._own[key] = factory()
        return self._own[key]

    def columns(self) -> dict[str, Any]:
        """Every section's columns, in the order the sections were made."""
        out: dict[str, Any] = {}
        for section in self._sections.values():
            out.update(columns(section))
        return out


_CURRENT: ContextVar[RoundContext | None] = ContextVar("edgefleet_round", default=None)


def current_round() -> RoundContext:
    """The context of the round being run. EdgeFleet's wrappers need one: they run inside
    :class:`~edgefleet.loop.roundloop.RoundLoop` (``strategy.start(...)`` runs it)."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "EdgeFleet's strategies run inside EdgeFleet's round loop: call "
            "strategy.start(grid, arrays, ...) (or RoundLoop(strategy, grid).run(...)), "
            "not Flower's loop around them"
        )
    return ctx


def round_or_none() -> RoundContext | None:
    """The current round's context, or None outside a round."""
    return _CURRENT.get()


@contextmanager
def in_round(ctx: RoundContext) -> Iterator[RoundContext]:
    """Make ``ctx`` current for the calls inside the ``with`` block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
