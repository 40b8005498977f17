"""Energy-aware age-based selection (EH-FedSAG, arXiv 2606.18758) around any strategy.

Each round the server broadcasts the global slot clock in a light ``query`` message; a
device advances its battery to that slot and answers with its level and whether it can
afford a round (Omega training slots + 1 transmission slot). No answer (offline, error)
means unavailable. Among the feasible devices the server takes up to M (orthogonal uplink
channels) with the largest age (rounds since their last upload), ties broken by a seeded
RNG, and only those get the train message. Ages reset on upload.

Devices are asked in descending age, ``batch_size`` at a time, until M feasible ones have
answered: the rule picks the oldest feasible devices, so asking the rest could not change
the selection, and a round's cost stays proportional to M rather than to the fleet
(``batch_size = 0`` asks everyone at once). A node is asked when it first appears, to learn
its stable device id (kept in the run's device registry), which orders it from then on;
when a device reconnects under a new node id, the registry retires the old id and it is
never asked again. The wrapper sends none of these queries itself: it plans them
(``plan_status``) and the round loop's status phase sends them
(:mod:`edgefleet.loop.status`), on the fleet's one slot clock, which this wrapper
declares (``slots_per_round``), as it declares the round's participant cap (M); a node
already asked this round (every node, under sessions) is not asked again. Wrapped around
FedAvg this is EH-FedAvg, around :class:`~edgefleet.strategies.fedsag.FedSAG` it is
EH-FedSAG.

``status_max_age`` > 0 (``selection.status-max-age``) skips the query where an answer is
known: a device whose last answer said "feasible" at most that many rounds ago (a status
answer, or its train reply, which the energy mod gives the battery after paying) is taken as
feasible (:meth:`EnergyAgeSelection._reusable` says why that is exact for harvesting
batteries). On a deployment each query is a round trip through the SuperNodes' polling and
a ClientApp start: 4-5 s a round on ``benchmarks/perf/link_fleet.py``'s fast links, as much as
the training round itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from logging import DEBUG, INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.algorithms.selection import (
    SELECTION_ORDERS,
    AgeTracker,
    SelectionError,
    query_order,
    select_in_batches,
)
from edgefleet.harvest import SOURCES
from edgefleet.loop.base import LoopStrategy, SubsetGrid
from edgefleet.loop.context import ScreeningRow, SelectionRow, current_round
from edgefleet.loop.registry import DeviceStatus, EnergyState
from edgefleet.loop.roundloop import RoundCallback, RoundResult
from edgefleet.loop.status import Ask, Declaration
from edgefleet.settings import (
    at_least,
    checked,
    choice,
    float_list,
    floats,
    fraction,
    positive,
    setting,
    unit_interval,
)

# With status reuse, a device is still asked when its last status answer is this many rounds
# old, so that its telemetry and presence in the fleet view stay recent.
STATUS_REFRESH_ROUNDS = 10

# How many selected devices the selection's log line names; a bigger fleet's line says how
# many more there were.
LOG_DEVICES = 10


class SelectionMode(StrEnum):
    """Who trains each round (``selection.mode``)."""

    ALL = "all"
    ENERGY_AGE = "energy-age"


SELECTIONS: tuple[str, ...] = tuple(m.value for m in SelectionMode)


@dataclass(frozen=True)
class EnergyConfig:
    """``selection.*``, ``energy.*``: EH-FedSAG's batteries and energy-aware selection.

    ``harvest_probs`` (simulation) gives partition i the probability
    ``harvest_probs[i % len]``; a SuperNode's ``--node-config harvest-prob=...`` overrides it.
    """

    selection: str = setting(
        "selection.mode",
        "all",
        choice(SELECTIONS),
        "`all`, `energy-age` (batteries + energy-aware age-based selection)",
    )
    order: str = setting(
        "selection.order",
        "age",
        choice(SELECTION_ORDERS),
        "energy-age selection's query order: `age` (oldest update first) or `random` (uniform)",
    )
    max_devices: int = setting("selection.max-devices", 25, at_least(1), "M: devices a round")
    batch_size: int = setting(
        "selection.batch-size", 0, at_least(0), "status queries per batch (0 = all at once)"
    )
    deadline: float = setting(
        "selection.deadline",
        0.0,
        at_least(0.0),
        "energy-age selection skips a device whose observed round (download + training + "
        "upload, timed by the server) exceeds this many seconds; never timed = fits (0 = off)",
    )
    deadline_retry: int = setting(
        "selection.deadline-retry",
        10,
        at_least(0),
        "a device skipped by `selection.deadline` this many rounds in a row is selectable "
        "again once, so its round is timed afresh (0 = never tried again)",
    )
    status_max_age: int = setting(
        "selection.status-max-age",
        0,
        at_least(0),
        "energy-age selection takes a device's answer `feasible` from at most this many rounds "
        "ago (a status query, or its last train reply) instead of asking again, saving a round "
        "trip a round; harvesting batteries give the same verdicts (0 = ask every round)",
    )
    source: str = setting(
        "energy.source", "bernoulli", choice(SOURCES), " ".join(f"`{s}`" for s in SOURCES)
    )
    capacity: float = setting("energy.capacity", 10.0, positive, "battery size (units)")
    harvest_prob: float = setting(
        "energy.harvest-prob", 0.5, unit_interval, "P_h: probability of an arrival per slot"
    )
    harvest_probs: tuple[float, ...] = setting(
        "energy.harvest-probs",
        "",
        float_list(0.0, 1.0, False, "0.1,0.5,0.9"),
        "simulation: comma-separated P_h, partition i takes entry i mod n",
        floats,
    )
    harvest_units: float = setting("energy.harvest-units", 1.0, at_least(0.0), "units per arrival")
    panel_area: float = setting(
        "energy.panel-area", 0.001, positive, "`solar`: panel area in m^2 (0.001 = 10 cm^2)"
    )
    panel_efficiency: float = setting(
        "energy.panel-efficiency", 0.2, fraction, "`solar`: share of the irradiance harvested"
    )
    slot_seconds: float = setting(
        "energy.slot-seconds", 60.0, positive, "`solar`: the length of a slot in seconds"
    )
    unit_joules: float = setting(
        "energy.unit-joules", 4.0, positive, "`solar`: joules in one battery unit"
    )
    train_slots: int = setting(
        "energy.train-slots",
        3,
        at_least(1),
        "Omega: a round costs Omega + 1 units (training + transmission)",
    )

    @property
    def round_cost(self) -> float:
        """Energy units one round costs: Omega slots of training plus one of transmission."""
        return float(self.train_slots + 1)

    @property
    def slots_per_round(self) -> int:
        """The global slot clock advances by one round's duration each round."""
        return self.train_slots + 1


def selection_line(
    selected: list[str],
    nodes: int,
    batteries: Mapping[str, float | None],
    asked: int,
    reused: int = 0,
) -> str:
    """The round's selection in words: ``2 of 4 nodes selected: 3 (battery 0.81), 7 (0.55);
    4 status queries``. ``asked`` 0 means the answers came from an earlier query of the round
    (the sessions wrapper's presence query), not that nobody was asked."""
    shown, labelled = [], False
    for device in selected[:LOG_DEVICES]:
        level = batteries.get(device)
        if level is None:  # a node that cannot report takes part without a level
            shown.append(device)
            continue
        shown.append(f"{device} ({'' if labelled else 'battery '}{level:.2f})")
        labelled = True
    if len(selected) > LOG_DEVICES:
        shown.append(f"and {len(selected) - LOG_DEVICES} more")
    text = f"{len(selected)} of {nodes} nodes selected"
    if shown:
        text += ": " + ", ".join(shown)
    if reused:
        text += f"; {reused} status{'' if reused == 1 else 'es'} from earlier answers"
    if asked:
        return f"{text}; {asked} status quer{'y' if asked == 1 else 'ies'}"
    if reused:
        return text
    if nodes:
        return f"{text}; statuses reused from this round's presence query"
    return text


@dataclass
class _Plan:
    """The round's selection, made in the status phase (kept in the round's context)."""

    planned: bool = False
    nodes: list[int] | None = None  # the selected devices' nodes
    online: int = 0


class EnergyAgeSelection(LoopStrategy, RoundCallback):
    @classmethod
    def from_config(
        cls,
        inner: Strategy,
        cfg: EnergyConfig,
        *,
        seed: int = 0,
        query_timeout: float = 60.0,
        first_answer_timeout: float | None = None,
    ) -> EnergyAgeSelection:
        """Energy-age selection as ``selection.*`` and ``energy.train-slots`` set it."""
        checked(cfg, "selection.mode", cfg.selection, (SelectionMode.ENERGY_AGE,), cls.__name__)
        return cls(
            inner,
            max_devices=cfg.max_devices,
            slots_per_round=cfg.slots_per_round,
            batch_size=cfg.batch_size,
            seed=seed,
            query_timeout=query_timeout,
            first_answer_timeout=first_answer_timeout,
            order=cfg.order,
            deadline=cfg.deadline,
            deadline_retry=cfg.deadline_retry,
            status_max_age=cfg.status_max_age,
        )

    def __init__(
        self,
        inner: Strategy,
        max_devices: int,
        slots_per_round: int,
        batch_size: int = 0,
        seed: int = 0,
        query_timeout: float = 60.0,
        first_answer_timeout: float | None = None,
        order: str = "age",
        deadline: float = 0.0,
        deadline_retry: int = 10,
        status_max_age: int = 0,
    ) -> None:
        super().__init__(inner)
        if not (
            isinstance(status_max_age, int)
            and not isinstance(status_max_age, bool)
            and status_max_age >= 0
        ):
            raise SelectionError(
                f"status_max_age={status_max_age!r} must be a whole number of rounds >= 0 "
                "(0 = ask every round)"
            )
        self.status_max_age = status_max_age
        if not deadline >= 0:
            raise SelectionError(f"deadline={deadline!r} must be >= 0 (0 = no deadline)")
        if not (isinstance(deadline_retry, int) and deadline_retry >= 0):
            raise SelectionError(
                f"deadline_retry={deadline_retry!r} must be a whole number of rounds >= 0 "
                "(0 = a skipped device is never tried again)"
            )
        self.deadline = deadline
        self.deadline_retry = deadline_retry
        # Consecutive rounds each device has been skipped by the deadline. Kept across rounds
        # (and checkpointed) like the ages: it is what lets a skipped device be re-timed.
        self._skips: dict[str, int] = {}
        if order not in SELECTION_ORDERS:
            raise SelectionError(f"order={order!r}; valid: {', '.join(SELECTION_ORDERS)}")
        self.order = order
        self.max_devices = max_devices
        self.slots_per_round = slots_per_round
        self.batch_size = batch_size
        self.query_timeout, self.first_answer_timeout = query_timeout, first_answer_timeout
        self.rng = np.random.default_rng(seed)
        self.ages = AgeTracker()

    def settings(self) -> dict[str, object]:
        return {
            "Max devices a round (M)": self.max_devices,
            "Slots a round": self.slots_per_round,
            "Status queries per batch": self.batch_size or "all at once",
            "Query order": self.order,
            "Deadline": f"{self.deadline:g} s" if self.deadline else "none",
            "Deadline retry": (
                f"after {self.deadline_retry} skipped rounds" if self.deadline_retry else "never"
            )
            if self.deadline
            else "-",
            "Status reused for": (
                f"{self.status_max_age} round(s), feasible answers only"
                if self.status_max_age
                else "- (asked every round)"
            ),
        }

    def slot(self, server_round: int) -> int:
        return (server_round - 1) * self.slots_per_round

    def own_declarations(self) -> list[Declaration]:
        return [
            Declaration(
                type(self).__name__,
                slots_per_round=self.slots_per_round,
                participant_cap=self.max_devices,  # FedSAG's M (its uplink channels)
                status=True,
                timeout=self.query_timeout,
                first_timeout=self.first_answer_timeout,
                dispatch=True,  # async: it chooses who starts when a slot frees
                round_barrier=(
                    f"{type(self).__name__}(deadline={self.deadline:g}) skips devices whose "
                    "round is slower than the deadline; the asynchronous loop has no round to "
                    "wait for (a slow device's update arrives stale and is discounted): use "
                    "deadline=0 there"
                    if self.deadline
                    else None
                ),
            )
        ]

    def _note(self, answers: Mapping[int, DeviceStatus]) -> None:
        """Track the devices that answered (their ages, and the inner strategy's fleet)."""
        devices = [a.device for a in answers.values()]
        self.ages.register(devices)
        self.register_devices(devices)

    def plan_status(
        self, server_round: int, arrays: ArrayRecord, nodes: Sequence[int], ask: Ask
    ) -> None:
        """The round's selection, made in the loop's status phase: ``ask`` is its only way to
        learn a battery. ``configure_train`` then sends to the selected devices."""
        ctx = current_round()
        plan = ctx.own(self, _Plan)
        plan.planned = True
        nodes = sorted(n for n in nodes if n not in ctx.registry.retired)
        plan.online = len(nodes)
        plan.nodes = self._choose(server_round, arrays, nodes, ask, self.max_devices)
        if not plan.nodes:
            row = ctx.section(SelectionRow)
            screening = ctx.section(ScreeningRow)
            screening.no_participants = (
                f"energy-age selection: nobody left after selection.deadline skipped "
                f"{len(row.deadline_skipped)} device(s)"
                if row.deadline_skipped
                else self._why_nobody(nodes, ctx.status)
            )
            log(WARNING, "Round %d: nobody selected: %s", server_round, screening.no_participants)

    def choose_to_start(
        self, clock_round: int, arrays: ArrayRecord, idle: Sequence[int], count: int, ask: Ask
    ) -> list[int] | None:
        """In the asynchronous loop: the oldest feasible idle devices, at most ``count``
        (the free slots), asked on the slot clock's round ``clock_round``. The version's row
        adds up every such choice (``status_queries``, ``selected``)."""
        retired = current_round().registry.retired
        nodes = sorted(n for n in idle if n not in retired)
        return self._choose(clock_round, arrays, nodes, ask, count, level=DEBUG)

    def _choose(
        self,
        server_round: int,
        arrays: ArrayRecord,
        nodes: list[int],
        ask: Ask,
        count: int,
        level: int = INFO,
    ) -> list[int]:
        """The oldest feasible of ``nodes``, at most ``count``, asking in age order a batch at
        a time (module docstring); their nodes, in selection order."""
        ctx = current_round()
        registry, heard = ctx.registry, ctx.status
        row = ctx.section(SelectionRow)
        known = registry.known
        # Answers an outer component had asked for (every node, under sessions).
        self._note({n: heard[n] for n in nodes if n in heard})

        def asked(batch: list[int]) -> None:
            self._note(ask(batch))
            row.status_queries += len(batch)

        # A node's first answer names its device. Asking newcomers before ordering keeps the
        # order, seeded ties included, on stable device ids: Flower's node ids change when a
        # node reconnects, and the Simulation Engine draws them afresh every run, so an order
        # keyed on them made two runs with one seed select different devices. A node that
        # answers is not asked this again; one that does not stays unknown (unavailable this
        # round) and is asked again next round.
        new = [n for n in nodes if not known(n) and n not in heard]
        if new:
            asked(new)
        node_of = {registry.name(n): n for n in nodes if known(n)}
        # A device the registry learnt of elsewhere (the server's census before round 1, a
        # train reply) is tracked from its first round here.
        self.ages.register(node_of)
        self.register_devices(node_of)
        order = query_order(self.ages.ages, node_of, self.rng, self.order)
        retried: list[str] = []
        if self.deadline:
            model_bytes = sum(len(a.data) for a in arrays.values())
            order, row.deadline_skipped, retried = self._within_deadline(order, model_bytes)
        batch = self.batch_size or max(1, len(order))

        reused: dict[str, float | None] = {}  # device -> the battery it last reported

        def feasible(devices: list[str]) -> dict[str, bool]:
            ask_now = []
            for d in devices:
                if node_of[d] in heard:
                    continue
                if (state := self._reusable(d, server_round)) is not None:
                    reused[d] = state.battery
                else:
                    ask_now.append(node_of[d])
            if ask_now:
                asked(ask_now)
            out = {d: heard[node_of[d]].feasible for d in devices if node_of[d] in heard}
            return {**out, **{d: True for d in devices if d in reused and d not in out}}

        selected, _ = select_in_batches(order, feasible, count, batch)
        row.selected.extend(selected)
        if reused:
            row.status_reused = (row.status_reused or 0) + len(reused)
        # A retried device's count starts over only once it is selected (and so re-timed); one
        # let through but not chosen (younger than M others, or without energy) stays let
        # through next round.
        row.deadline_retried = [d for d in retried if d in selected] or None
        for device in row.deadline_retried or ():
            self._skips.pop(device, None)
        if selected or level >= INFO:
            log(
                level,
                "energy-age selection: %s",
                selection_line(
                    selected, len(nodes),
                    {d: reused[d] if d in reused else heard[node_of[d]].battery for d in selected},
                    row.status_queries, len(reused),
                ),
            )  # fmt: skip
        return [node_of[d] for d in selected]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        ctx = current_round()
        plan = ctx.own(self, _Plan)
        if not plan.planned:
            if ctx.asynchronous:  # a version's template: the loop addresses it, slot and all
                return self.inner.configure_train(server_round, arrays, config, grid)
            raise RuntimeError(
                "EnergyAgeSelection selects in the round loop's status phase: run it with "
                "strategy.start(...) or RoundLoop, which runs the phase before configure_train"
            )
        if not plan.nodes:
            return []
        config = ConfigRecord({**dict(config), "slot": ctx.slot})
        subset = SubsetGrid(grid, plan.nodes)
        return self.inner.configure_train(server_round, arrays, config, subset)  # type: ignore[arg-type]

    def _reusable(self, device: str, server_round: int) -> EnergyState | None:
        """``device``'s last energy answer, when it may stand for this round's: it said
        feasible at most ``status_max_age`` rounds ago (a status answer, or its train reply
        after paying for that round), and its last status answer is less than
        ``STATUS_REFRESH_ROUNDS`` old.

        A battery that only gains energy while idle, as the harvesting sources do, is still
        feasible then, so the energy verdict is the one asking would give; an infeasible
        answer is never reused (the device may have harvested since). What asking also
        checks is that the device is there: a device whose node died after its last reply,
        and that Flower still lists (until its heartbeat expires), is selected once more
        and its round misses it, where a query would have left it out and taken the next
        device. A board whose battery also drains (``sysfs``) may decline the round it was
        selected for. Either costs that round one device; the device is asked next time
        (its train message forgot the answer)."""
        if not self.status_max_age:
            return None
        registry = current_round().registry
        state = registry.energy(device)
        if state is None or not state.feasible:
            return None
        # The status answer also carries presence and telemetry (temperature, load,
        # memory): a device that trains every round is still asked now and then.
        if server_round - registry.status_round(device) >= STATUS_REFRESH_ROUNDS:
            return None
        return state if server_round - state.round <= self.status_max_age else None

    def _within_deadline(
        self, order: list[str], model_bytes: int
    ) -> tuple[list[str], list[str] | None, list[str]]:
        """``order`` without the devices whose expected round exceeds the deadline, those
        skipped (None: none), and those let through
        although slow because they have been skipped ``deadline_retry`` rounds in a row.
        Without the retry a skipped device is never timed again, so a board that moved closer
        to its access point would stay out for good; with it, it is tried once every
        ``deadline_retry`` rounds and its estimate follows what it does now. Age order is
        kept, so among the devices that fit the oldest still go first; a skipped device keeps
        ageing, so a retried one is near the front.

        The expected round is the one observed (:meth:`DeviceRegistry.link`). A device
        never timed is assumed to fit, unless it declared its link's rate (``link-kbps``):
        then the model down and an update of its size up over that rate, compute not
        counted; the full model's bytes, so a CA-HFP device that will get only its slice is
        overestimated, never under. Without that, the first round of a board on a 512
        kbit/s modem held the whole fleet's first round (30 s against 8,
        ``benchmarks/perf/link_fleet.py``)."""
        registry = current_round().registry
        fits: list[str] = []
        skipped: list[str] = []
        retried: list[str] = []
        for device in order:
            link = registry.link(device)
            expected = None if link is None else link.expected_s()
            if expected is None and (kbps := registry.declared_kbps(device)) is not None:
                expected = 2 * model_bytes * 8 / (kbps * 1000)
            if expected is None or expected <= self.deadline:
                self._skips.pop(device, None)
                fits.append(device)
            elif self.deadline_retry and self._skips.get(device, 0) >= self.deadline_retry:
                fits.append(device)
                retried.append(device)
            else:
                self._skips[device] = self._skips.get(device, 0) + 1
                skipped.append(device)
        if skipped:
            log(INFO, "energy-age selection: %d device(s) skipped, their rounds take longer than "
                "the %g s deadline: %s", len(skipped), self.deadline,
                ", ".join(skipped[:LOG_DEVICES]))  # fmt: skip
        if retried:
            log(INFO, "energy-age selection: %d slow device(s) tried again after %d skipped "
                "rounds, to be re-timed: %s", len(retried), self.deadline_retry,
                ", ".join(retried[:LOG_DEVICES]))  # fmt: skip
        return fits, skipped or None, retried

    def _why_nobody(self, nodes: list[int], heard: Mapping[int, DeviceStatus]) -> str:
        """Why this round's selection is empty, for the row and the log."""
        answered = [n for n in nodes if n in heard]
        if not nodes:
            return "energy-age selection: no node online"
        if not answered:
            return (
                f"energy-age selection: none of the {len(nodes)} nodes answered the status "
                "query in time"
            )
        return (
            f"energy-age selection: none of the {len(answered)} devices that answered can "
            "afford a round (battery below its cost)"
        )

    def after_round(self, result: RoundResult) -> str | None:
        self.ages.on_round(result.participants)
        result.context.section(SelectionRow)  # zero queries, nobody selected: still a row
        return None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(ages=self.ages.state_dict(), rng=self.rng.bit_generator.state)
        state["deadline_skips"] = dict(self._skips)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ages.load_state_dict(state["ages"])
        self.rng.bit_generator.state = state["rng"]
        # Absent from checkpoints written before the retry existed: nobody skipped yet.
        self._skips = {str(k): int(v) for k, v in state.get("deadline_skips", {}).items()}
