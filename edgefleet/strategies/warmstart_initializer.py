"""Sessions and warm-start initialization around any strategy (arXiv 2410.05662).

:class:`WarmStartInitializer` is the outermost wrapper. Every round it needs to know
whether each online node's device is present: it declares so, and the round loop's status
phase asks every online node once (a light ``query`` message on the fleet's slot clock; in
simulation presence follows the scenario's schedule on the client, in deployment a departed
device is simply offline). The wrapper feeds the present set to a
:class:`~edgefleet.algorithms.tracker.SessionTracker` and hands the inner strategy the
present nodes only; energy-aware selection inside reads the same answers from the round
context instead of asking again. That costs one message per online node per round (counted
in the row's ``presence_queries``). A node that answers with an error is unknown this
round, not departed: its device stays in the session, and gets no train message. When a
new session opens it
stores the finished session's final model and builds the new session's initial model as
``warmstart.mode`` says (see :mod:`edgefleet.algorithms.warmstart`):

- ``pilot``: sessions 1..P run on from the previous model; their final models average into
  the pilot model. From session P+1 on, V auxiliary rounds of the inner strategy run from
  the pilot model on the present devices (real rounds: they cost energy and bytes and are
  counted in the session's time to accuracy); their result minus the pilot is the session's
  pseudo-gradient, and the session starts from the softmin-weighted average of the stored
  post-pilot sessions' final models (the first post-pilot session, with nothing stored, from
  the previous model, as the baseline does).
- ``previous`` / ``average`` / ``fresh``: the baselines, without auxiliary rounds.
- ``continuous``: ``previous`` plus a KL term to the last session's final model in every
  device's local loss (the paper's Continuous baseline).

Two small wrappers of their own sit right inside it, made by it from its arguments:
:class:`~edgefleet.strategies.lrschedule.SessionLearningRate` (given a base ``lr``: the
round's client learning rate in every train config, decaying within each session, lower in
auxiliary rounds) and, in mode ``continuous``,
:class:`~edgefleet.strategies.teacher.ContinuousTeacher` (the last session's final model as
a KL teacher, sent once per device and session). Both read what they need of sessions from
the round context (the session number, the phase, the last session's model), so the
learning-rate schedule also works under any other wrapper.

Wrappers inside are told of each boundary through ``on_session`` (the data-free stopping
rule restarts from the session's initial model, and under sessions a plateau rests the
devices until the next session instead of ending the run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.algorithms.tracker import SessionTracker
from edgefleet.algorithms.warmstart import (
    WARMSTART_MODES,
    SessionStore,
    StoredSession,
    WarmStartError,
    average_states,
    distance_keys,
    pilot_model,
    pseudo_gradient,
    warm_start_model,
)
from edgefleet.arrays import State, to_numpy, to_record
from edgefleet.loop.base import LoopStrategy, SubsetGrid
from edgefleet.loop.context import ScreeningRow, SessionRow, current_round
from edgefleet.loop.registry import DeviceStatus
from edgefleet.loop.roundloop import RoundCallback, RoundResult
from edgefleet.loop.status import Ask, Declaration
from edgefleet.settings import (
    anything,
    at_least,
    checked,
    choice,
    fraction,
    half_open_fraction,
    positive,
    setting,
    unit_interval,
)
from edgefleet.strategies.lrschedule import SessionLearningRate
from edgefleet.strategies.teacher import ContinuousTeacher


class SessionSchedule(StrEnum):
    """Which devices are present in which session (``sessions.schedule``)."""

    NONE = "none"
    ALTERNATE = "alternate"


SESSION_SCHEDULES: tuple[str, ...] = tuple(m.value for m in SessionSchedule)


@dataclass(frozen=True)
class SessionsConfig:
    """``sessions.*``: device arrival and departure.

    Sessions are on when ``schedule = "alternate"``, ``rounds > 0`` or ``warmstart.mode`` is
    not ``"previous"``; otherwise every round belongs to one run-long stretch.
    ``schedule = "alternate"`` (simulation): devices form ``groups`` groups (partition i is
    in group ``i % groups``) with label sets overlapping by ``label_overlap``; group
    ``s % groups`` is present in session s, each session lasting ``rounds`` rounds, for
    ``count`` sessions. ``"none"``: every device is present whenever it is online, as in a
    deployment; a new session starts when the present set changes by more than
    ``change_threshold`` or after ``rounds`` rounds (0 = no length limit).
    """

    schedule: str = setting(
        "sessions.schedule",
        "none",
        choice(SESSION_SCHEDULES),
        "`none` (presence = online), `alternate` (simulation: groups take turns)",
    )
    count: int = setting("sessions.count", 1, at_least(1), "S sessions (`alternate`)")
    rounds: int = setting(
        "sessions.rounds",
        0,
        at_least(0),
        "T rounds a session (`alternate`: num-server-rounds must be S x T); 0 = no limit",
    )
    groups: int = setting(
        "sessions.groups", 2, at_least(1), "device groups (partition i in group i mod groups)"
    )
    label_overlap: float = setting(
        "sessions.label-overlap",
        0.0,
        unit_interval,
        "the share of the other groups' classes each group also holds",
    )
    change_threshold: float = setting(
        "sessions.change-threshold",
        0.2,
        half_open_fraction,
        "a new session when the present set differs from the founding set by more than this "
        "(Jaccard distance)",
    )
    target_accuracy: float = setting(
        "sessions.target-accuracy",
        0.8,
        fraction,
        "per-session time to this accuracy on the session's classes",
    )


@dataclass(frozen=True)
class WarmStartConfig:
    """``warmstart.*``: how each new session's initial model is built (arXiv 2410.05662)."""

    mode: str = setting(
        "warmstart.mode",
        "previous",
        choice(WARMSTART_MODES),
        "`pilot` (the paper), `previous`, `average`, `fresh`, `continuous` (the paper's "
        "baseline: `previous` + a KL term to the last session's model; EdgeFleet's ClientApp)",
    )
    pilot_sessions: int = setting("warmstart.pilot-sessions", 1, at_least(1), "P pilot sessions")
    aux_rounds: int = setting(
        "warmstart.aux-rounds", 1, at_least(1), "V auxiliary rounds per later session"
    )
    temperature: float = setting("warmstart.temperature", 10.0, positive, "softmin R")
    aux_lr_scale: float = setting(
        "warmstart.aux-lr-scale",
        0.5,
        fraction,
        "`pilot`: auxiliary rounds train at `lr` x this, constant (the reference: half)",
    )
    kl_lambda: float = setting(
        "warmstart.kl-lambda",
        0.5,
        at_least(0.0),
        "`continuous`: weight of KL(last session's model || local model) in the local loss",
    )
    reset_after_pilot: bool = setting(
        "warmstart.reset-after-pilot",
        False,
        anything,
        "the first post-pilot session starts from the initial model in every mode, as the "
        "reference's experiments do (false: from the last model)",
    )
    pilot_candidates: bool = setting(
        "warmstart.pilot-candidates",
        True,
        anything,
        "`pilot`: the pilot sessions' own models are candidates too (fingerprint: final "
        "minus pilot model; needs P >= 2); false: only averaged into the pilot model, as "
        "the reference does",
    )
    max_stored: int = setting(
        "warmstart.max-stored", 10, at_least(1), "stored session models kept (oldest evicted)"
    )


class Phase(StrEnum):
    """What a session's rounds do: train, or first run its auxiliary rounds (mode
    ``pilot``: V rounds from the pilot model, for the session's pseudo-gradient)."""

    TRAIN = "train"
    AUX = "aux"


@dataclass
class _Round:
    """What the sessions wrapper learns in one round (kept in the round's context)."""

    present: dict[int, DeviceStatus] = field(default_factory=dict)  # present nodes' answers
    answered: int = 0  # nodes that answered the presence query
    planned: bool = False  # the status phase ran this wrapper's plan this round


class WarmStartInitializer(LoopStrategy, RoundCallback):
    """Sessions over a changing device set, each started from a warm model."""

    @classmethod
    def from_config(
        cls,
        inner: Strategy,
        warmstart: WarmStartConfig,
        sessions: SessionsConfig,
        *,
        store: SessionStore | str | os.PathLike[str],
        initial: ArrayRecord,
        param_keys: list[str] | None = None,
        lr: float | None = None,
        lr_min_ratio: float = 1.0,
        **fleet: Any,
    ) -> WarmStartInitializer:
        """Sessions as ``sessions.*`` and ``warmstart.*`` set them; ``lr`` and ``lr_min_ratio``
        from the run's learning-rate schedule, ``fleet`` (``slots_per_round``,
        ``query_timeout``, ``first_answer_timeout``) from the fleet's clock and waits."""
        w, s = checked(warmstart), checked(sessions)
        return cls(
            inner,
            store=store,
            tracker=SessionTracker(s.change_threshold, s.rounds),
            initial=initial,
            param_keys=param_keys,
            max_stored=w.max_stored,
            mode=w.mode,
            pilot_sessions=w.pilot_sessions,
            aux_rounds=w.aux_rounds,
            temperature=w.temperature,
            lr=lr,
            lr_min_ratio=lr_min_ratio,
            aux_lr_scale=w.aux_lr_scale,
            kl_lambda=w.kl_lambda,
            reset_after_pilot=w.reset_after_pilot,
            pilot_candidates=w.pilot_candidates,
            **fleet,
        )

    def __init__(
        self,
        inner: Strategy,
        *,
        store: SessionStore | str | os.PathLike[str],
        initial: ArrayRecord,
        tracker: SessionTracker | None = None,
        param_keys: list[str] | None = None,
        max_stored: int = 10,
        mode: str = "pilot",
        pilot_sessions: int = 1,
        aux_rounds: int = 1,
        temperature: float = 10.0,
        slots_per_round: int | None = None,
        query_timeout: float = 60.0,
        first_answer_timeout: float | None = None,
        lr: float | None = None,
        lr_min_ratio: float = 1.0,
        aux_lr_scale: float = 0.5,
        kl_lambda: float = 0.5,
        reset_after_pilot: bool = False,
        pilot_candidates: bool = True,
    ) -> None:
        """``store``: a :class:`SessionStore`, or the folder of one, opened if an earlier run
        left one there (new sessions then continue its numbering and are warm-started from
        its models) and made otherwise, keeping ``max_stored`` candidates. ``tracker``:
        when sessions open (default: when a fifth of the present set changes, no length
        limit). ``param_keys``: the trainable parameters the session distance is taken over
        (default: every floating-point array of ``initial``).
        ``slots_per_round``: the fleet's energy slot clock, when no other component declares
        it (None: energy-aware selection inside declares it, or 1 without one; a different
        value from the selection's is refused before round 1).
        ``first_answer_timeout``: how long the presence query waits for a node never heard
        from (its first answer may wait for its data to load). ``lr``: the devices' base
        learning rate; given, every train message carries the
        round's rate (``lr_min_ratio`` < 1: decaying within each session, which needs the
        tracker's ``max_rounds``; auxiliary rounds at lr x ``aux_lr_scale``). None: no rate
        is sent. ``kl_lambda``: the KL weight of mode ``continuous``.
        ``reset_after_pilot``: session P + 1 starts from ``initial`` in every mode, as in the
        reference's experiments. ``pilot_candidates`` (mode ``pilot``): the pilot sessions'
        own final models are weighed too, fingerprinted by their final model minus the pilot
        model (the reference only averages them, so a group seen only in the pilots has
        nothing of its own to be warm-started from); with one pilot session that difference
        is zero and it stays out."""
        if not isinstance(store, SessionStore):
            store = SessionStore.open(store, max_stored)
            if last := store.last_session():
                log(INFO, "Session store %s holds sessions up to %d from an earlier run: new "
                    "sessions continue from there", store.directory, last)  # fmt: skip
        if tracker is None:
            tracker = SessionTracker(change_threshold=0.2, max_rounds=0)
        if tracker.session == 0:
            tracker.session = store.last_session()
        if param_keys is None:
            param_keys = [k for k, a in initial.items() if a.numpy().dtype.kind == "f"]
        if mode not in WARMSTART_MODES:
            raise WarmStartError(f"mode {mode!r}; valid choices: {', '.join(WARMSTART_MODES)}")
        if mode == "continuous":
            inner = ContinuousTeacher(inner, kl_lambda)
        if lr is not None:
            inner = SessionLearningRate(
                inner,
                lr,
                min_ratio=lr_min_ratio,
                session_rounds=tracker.max_rounds,
                aux_scale=aux_lr_scale,
            )
        super().__init__(inner)
        self.reset_after_pilot, self.pilot_candidates = reset_after_pilot, pilot_candidates
        self.store, self.tracker = store, tracker
        self.initial = to_numpy(initial)
        self.keys = distance_keys(self.initial, param_keys)
        self.mode, self.pilot_sessions = mode, pilot_sessions
        self.aux_rounds, self.temperature = aux_rounds, temperature
        self.slots_per_round = slots_per_round
        self.query_timeout, self.first_answer_timeout = query_timeout, first_answer_timeout
        self.session_devices: list[str] = []
        self.phase = Phase.TRAIN
        self.aux_left = 0
        self.aux_start: State | None = None  # the pilot model the aux rounds started from
        self.pending_grad: State | None = None  # this session's pseudo-gradient
        self.previous: ArrayRecord | None = None  # the model when the session opened

    def settings(self) -> dict[str, object]:
        s: dict[str, object] = {"Mode": self.mode}
        s["Change threshold"] = self.tracker.change_threshold
        if self.tracker.max_rounds:
            s["Session length (rounds)"] = self.tracker.max_rounds
        if self.mode == "pilot":
            s.update(
                {
                    "Pilot sessions": self.pilot_sessions,
                    "Auxiliary rounds": self.aux_rounds,
                    "Softmin temperature": self.temperature,
                    "Pilot sessions as candidates": self.pilot_candidates,
                }
            )
        if self.reset_after_pilot:
            s["First post-pilot session from"] = "the initial model"
        return s

    # -- presence -----------------------------------------------------------------------

    def own_declarations(self) -> list[Declaration]:
        return [
            Declaration(
                type(self).__name__,
                slots_per_round=self.slots_per_round,
                status=True,
                every_node=True,  # presence: every device, every round
                labels=True,  # the session accuracy's classes
                timeout=self.query_timeout,
                first_timeout=self.first_answer_timeout,
            )
        ]

    # -- session boundaries -------------------------------------------------------------

    def _finish_session(self, session: int, final: ArrayRecord) -> None:
        """Store the session that just ended (the tracker has already moved on)."""
        if session < 1 or self.mode in ("previous", "fresh"):
            return  # these modes never look back
        grad: State | None = self.pending_grad
        if self.mode == "average":
            # Every session is a candidate of the average (so max-stored evicts them); the
            # displacement from the initial model stands in for the unused pseudo-gradient.
            grad = pseudo_gradient(to_numpy(final), self.initial)
        elif session <= self.pilot_sessions:
            grad = None
        elif grad is None:
            return  # a post-pilot session without a pseudo-gradient cannot be weighed
        self.store.add(StoredSession(session, to_numpy(final), grad, self.session_devices))

    def _resets(self, session: int) -> bool:
        """Whether ``session`` starts from the initial model where it would carry on."""
        return self.reset_after_pilot and session == self.pilot_sessions + 1

    def _open_session(self, session: int, arrays: ArrayRecord) -> ArrayRecord | None:
        """The new session's initial model, or None when auxiliary rounds must run first."""
        stored = self.store.pilots() + self.store.candidates()
        self.pending_grad = None
        if self.mode == "pilot" and session > self.pilot_sessions and self.store.pilots():
            # The aux rounds run even in a reset session: its pseudo-gradient is stored.
            self.aux_start = pilot_model([s.final for s in self.store.pilots()])
            self.aux_left = self.aux_rounds
            self.phase = Phase.AUX
            current_round().start_from = to_record(self.aux_start)
            return None
        if (self.mode == "fresh" and session > 1) or self._resets(session):
            return to_record(self.initial)
        if self.mode == "average" and stored:
            finals = [s.final for s in stored]
            return to_record(average_states(finals, [1.0] * len(finals)))
        return arrays

    def _warm_model(self, aux_result: ArrayRecord, previous: ArrayRecord) -> ArrayRecord:
        assert self.aux_start is not None
        self.pending_grad = pseudo_gradient(to_numpy(aux_result), self.aux_start)
        row = current_round().section(SessionRow)
        if self._resets(self.tracker.session):  # the reference's regime: from the initial model
            row.warmstart_weights = []
            return to_record(self.initial)
        candidates = self._pilot_candidates() + self.store.candidates()
        if not candidates:
            row.warmstart_weights = []
            return previous
        model, weights = warm_start_model(
            self.pending_grad, candidates, self.keys, self.temperature
        )
        row.warmstart_weights = {
            str(s.session): round(float(w), 4) for s, w in zip(candidates, weights, strict=True)
        }
        log(INFO, "Warm start weights over stored sessions: %s", row.warmstart_weights)
        return to_record(model)

    def _pilot_candidates(self) -> list[StoredSession]:
        """The pilot sessions as candidates (``pilot_candidates``): each one's pseudo-gradient
        stand-in is its final model minus the pilot model, the direction the aux rounds of a
        new session of the same devices would take from it. With one pilot session it is the
        zero vector (no direction) and that session is left out."""
        pilots = self.store.pilots()
        if not self.pilot_candidates or len(pilots) < 2:
            return []
        assert self.aux_start is not None
        return [
            StoredSession(p.session, p.final, pseudo_gradient(p.final, self.aux_start), p.devices)
            for p in pilots
        ]

    # -- Strategy -----------------------------------------------------------------------

    def plan_status(
        self, server_round: int, arrays: ArrayRecord, nodes: Sequence[int], ask: Ask
    ) -> None:
        """The round's presence (from the status phase's answers of every online node), the
        session boundary it makes, and the present nodes handed to the wrappers inside."""
        ctx = current_round()
        row, mine = ctx.section(SessionRow), ctx.own(self, _Round)
        mine.planned = True
        row.presence_queries = len(nodes)
        answers = {n: ctx.status[n] for n in nodes if n in ctx.status}
        mine.answered = len(answers)
        mine.present = {node: status for node, status in answers.items() if status.present}
        present_nodes = sorted(mine.present)
        present = [mine.present[n].device for n in present_nodes]
        row.present = len(present)
        # A device whose node answered with an error is unknown this round: it has not left
        # (a departure would open a session), it only gets no train message.
        unknown = {ctx.registry.name(n) for n in ctx.status_errors if n in nodes}
        staying = [d for d in self.session_devices if d in unknown and d not in present]
        previous_session = self.tracker.session
        change = self.tracker.update(server_round, present + staying)
        ctx.session = self.tracker.session
        if change is not None:
            log(
                INFO,
                "Session %d opens at round %d (%s): %d arrived %s, %d left %s",
                change.session,
                server_round,
                change.reason,
                len(change.arrived),
                sorted(change.arrived),
                len(change.left),
                sorted(change.left),
            )
            if self.phase == Phase.AUX:
                # The last session ended during its auxiliary rounds: it never trained, and
                # the loop's model is a half-done aux result, not a session's final model.
                self.phase, ctx.start_from = Phase.TRAIN, None
            else:
                if self.previous is not None:  # a session of this run (not the store's last)
                    self._finish_session(previous_session, arrays)
                self.previous = arrays
            self.session_devices = sorted(present + staying)
            assert self.previous is not None
            start = self._open_session(change.session, self.previous)
            if start is not None and start is not arrays:
                ctx.start_from = start
            super().on_session(start)
            row.arrived, row.left = sorted(change.arrived), sorted(change.left)
        if not present_nodes:
            why = f"sessions: no device present ({mine.answered} of {len(nodes)} nodes answered)"
            log(WARNING, "Round %d: nobody selected: %s", server_round, why)
            ctx.section(ScreeningRow).no_participants = why
            return
        # What the learning-rate schedule and the continuous teacher inside read.
        row.phase, ctx.last_session_model = self.phase, self.previous
        send = arrays if ctx.start_from is None else ctx.start_from
        super().plan_status(server_round, send, present_nodes, ask)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        ctx = current_round()
        mine = ctx.own(self, _Round)
        if not mine.planned:
            raise RuntimeError(
                "WarmStartInitializer learns presence in the round loop's status phase: run "
                "it with strategy.start(...) or RoundLoop, which runs the phase first"
            )
        if not mine.present:
            return []
        send = arrays if ctx.start_from is None else ctx.start_from
        present = SubsetGrid(grid, sorted(mine.present))
        return super().configure_train(server_round, send, config, present)  # type: ignore[arg-type]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on this round's present devices only."""
        nodes = SubsetGrid(grid, sorted(current_round().own(self, _Round).present))
        return super().configure_evaluate(server_round, arrays, config, nodes)  # type: ignore[arg-type]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        ctx = current_round()
        arrays, metrics = super().aggregate_train(server_round, replies)
        trained = arrays is not None
        if not trained:  # nobody trained: the model the round started from stands
            arrays = ctx.start_from
        if self.phase != Phase.AUX:
            return arrays, metrics
        row = ctx.section(SessionRow)
        row.phase = Phase.AUX
        if trained:  # an auxiliary round nobody took part in is run again
            self.aux_left -= 1
        if self.aux_left > 0 or arrays is None:
            return arrays, metrics
        self.phase = Phase.TRAIN
        assert self.previous is not None
        warm = self._warm_model(arrays, self.previous)
        super().on_session(warm)
        # This row's central evaluation is of the warm model: the session's start.
        row.warm_start = True
        return warm, metrics

    # -- RoundCallback ------------------------------------------------------------------

    def on_end(self, arrays: ArrayRecord, last_round: int) -> None:
        """The run ends: the open session is stored with the final model, as a boundary
        would store it, so that the next run on this store (a user's second
        ``strategy.start``, a new ``flwr run`` of EdgeFleet's ServerApp) continues from it. A
        session still in its auxiliary rounds never trained and is not stored."""
        if self.phase == Phase.AUX or self.previous is None:
            return
        session = self.tracker.session
        if session in {s.session for s in self.store.pilots() + self.store.candidates()}:
            return  # already stored (a run that ended twice on one object)
        self._finish_session(session, arrays)

    def after_round(self, result: RoundResult) -> str | None:
        """The row's accuracy on the classes of this round's present devices."""
        row = result.context.section(SessionRow)
        present = result.context.own(self, _Round).present.values()
        classes = sorted({c for status in present for c in status.labels})
        counts = [result.per_class[c] for c in classes if c in result.per_class]
        correct = sum(c.correct for c in counts)
        total = sum(c.total for c in counts)
        row.session_classes = classes
        row.session_accuracy = correct / total if total else None
        return None

    # -- checkpoint ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            tracker=self.tracker.state_dict(),
            session_devices=self.session_devices,
            phase=self.phase,
            aux_left=self.aux_left,
            aux_start=self.aux_start,
            pending_grad=self.pending_grad,
            start_from=None,  # round state, kept in the round's context (format kept)
            previous=None if self.previous is None else to_numpy(self.previous),
        )
        return state  # the stored sessions are on disk in the store's own folder

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.tracker.load_state_dict(state["tracker"])
        self.session_devices = state["session_devices"]
        self.phase, self.aux_left = Phase(state["phase"]), state["aux_left"]
        self.aux_start, self.pending_grad = state["aux_start"], state["pending_grad"]
        self.previous = None if state["previous"] is None else to_record(state["previous"])
