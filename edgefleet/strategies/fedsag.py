"""FedSAG: FedAvg's round with SAGA-style server memory (the aggregation of EH-FedSAG).

"EH-FedSAG", arXiv 2606.18758. With partial participation (devices that can only join when
their harvested energy allows) the plain average of whoever took part swings from round to
round. FedSAG keeps, per device, the last update it sent (its memory m_k) and moves the
model along

    v_t = mean over all K devices of m_k  +  w * sum over participants S of (delta_k - m_k)

then replaces the participants' memories by their new deltas; theta += server_lr * v_t.
The correction weight ``w`` is, by default (``correction="channels"``), 1/max(|S|, M) where
M is the devices a round has room for: the cap of the selection wrapper around it
(:class:`~edgefleet.strategies.energy_selection.EnergyAgeSelection`'s ``max_devices``, EH-FedSAG's
uplink channels), so a round that few devices could afford does not inflate its stale
corrections; without such a cap, 1/|S|. ``correction="participants"`` is the seed's 1/|S|
always. The same default holds in EdgeFleet's app and in yours.
With everyone participating and every memory filled this is exactly FedAvg's (unweighted)
mean update. Choose it over FedAvg when few devices take part per round and the data are
non-IID; it costs one parameter vector of server memory per device.

Robust FedSAG (``robust``, ``robust_params``: a rule of :mod:`edgefleet.strategies.robust`):
the rule takes the place of both means, v = R(memories) + w |S| R(corrections), where R over
the memories runs over the stored memories (under ``mean_over="fleet"`` plus one zero memory
per registered device without one) and R over the round's corrections (delta_k - m_k) of its
participants; with R the plain mean this is the formula above. A poisoned memory is then
out-voted instead of averaged in, at O(K x D) a round instead of the running sum's O(|S| x D).
``max_age`` (rounds, 0 = off): before each round, memories stored more than ``max_age``
rounds ago expire from the mean (the device keeps its place in K with the zero memory), so a
device that uploads one poisoned update and stays away loses its hold after ``max_age``
rounds; an honest device that is away that long loses its stale contribution too. The expired
devices go in the row's ``saga_expired``. (Under CA-HFP the rule sees the rebuilt full-size
updates, not the masks.)

Used alone (``FedSAG(...).start(grid, arrays, ...)``) it runs in EdgeFleet's round loop, as
every EdgeFleet strategy does, so its replies are screened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from edgefleet.algorithms.saga import (
    SAGA_CORRECTIONS,
    SAGA_ESTIMATORS,
    SAGA_INITS,
    SAGA_MEANS,
    SagaError,
    SagaMemory,
    flatten,
    unflatten,
)
from edgefleet.arrays import to_numpy, to_record
from edgefleet.loop.base import start_on_loop
from edgefleet.loop.context import RobustRow, current_round
from edgefleet.loop.hooks import StrategyHooks
from edgefleet.loop.screening import reply_arrays, reply_device
from edgefleet.loop.status import Declaration
from edgefleet.settings import at_least, checked, choice, positive, setting
from edgefleet.strategies.robust import RobustConfig, robust_aggregate, rule_spec


@dataclass(frozen=True)
class SagaConfig:
    """``server-lr`` and ``saga.*``: FedSAG's server step and memory (also the server step of
    MIFA, FedVARP and SCAFFOLD, which fix the rest)."""

    server_lr: float = setting("server-lr", 1.0, positive, "FedSAG's server step")
    init: str = setting(
        "saga.init", "zeros", choice(SAGA_INITS), "FedSAG's memory start: `zeros`, `first-update`"
    )
    estimator: str = setting(
        "saga.estimator",
        "saga",
        choice(SAGA_ESTIMATORS),
        "FedSAG's direction: `saga` (memory mean + the participants' corrections) or `sag` "
        "(memory mean after the participants' memories are replaced)",
    )
    memory_mean: str = setting(
        "saga.memory-mean",
        "fleet",
        choice(SAGA_MEANS),
        "what FedSAG's memory mean divides by: `fleet` (all registered devices, one that never "
        "uploaded counting as zero) or `stored` (the devices that have a memory)",
    )
    correction: str = setting(
        "saga.correction",
        "channels",
        choice(SAGA_CORRECTIONS),
        "weight of each participant's correction: `channels` (1/max(participants, M)) or "
        "`participants` (1/participants)",
    )
    max_age: int = setting(
        "saga.max-age",
        0,
        at_least(0),
        "FedSAG: a memory stored more than this many rounds ago expires from the memory mean "
        "(the device counts as zero until it uploads again; 0 = never)",
    )


class FedSAG(StrategyHooks, FedAvg):
    """FedAvg's messages; SAGA-corrected aggregation. Devices are keyed by the
    ``device-id`` metric of their replies, so a node that reconnects keeps its memory; a
    reply without one (a standard Flower ClientApp) is keyed by its node id."""

    # The SagaConfig fields a fixed form of FedSAG (MIFA, FedVARP) does not take.
    FIXED_FORM: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, saga: SagaConfig, robust: RobustConfig, **fedavg_kwargs: Any) -> FedSAG:
        """FedSAG (or a fixed form of it) as ``server-lr``, ``saga.*`` and ``robust.*`` set
        it; ``fedavg_kwargs`` go to Flower's FedAvg."""
        saga, robust = checked(saga), checked(robust)
        form: dict[str, Any] = {
            "init": saga.init,
            "estimator": saga.estimator,
            "mean_over": saga.memory_mean,
            "correction": saga.correction,
        }
        return cls(
            server_lr=saga.server_lr,
            robust=robust.rule,
            robust_params=robust.params(),
            max_age=saga.max_age,
            **{k: v for k, v in form.items() if k not in cls.FIXED_FORM},
            **fedavg_kwargs,
        )

    def __init__(
        self,
        server_lr: float = 1.0,
        init: str = "zeros",
        estimator: str = "saga",
        mean_over: str = "fleet",
        correction: str = "channels",
        correction_floor: float = 0.0,
        robust: str = "off",
        robust_params: Mapping[str, Any] | None = None,
        max_age: int = 0,
        **fedavg_kwargs: Any,
    ) -> None:
        """``correction_floor``: a fixed M for ``correction="channels"`` where no selection
        wrapper caps the round (the larger of the two applies). ``robust``,
        ``robust_params``, ``max_age``: the module docstring."""
        super().__init__(**fedavg_kwargs)
        self.robust = rule_spec(robust, **dict(robust_params or {}))
        if isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0:
            raise SagaError(f"max_age={max_age!r} must be an integer >= 0 (0: off)")
        self.max_age = max_age
        if correction not in SAGA_CORRECTIONS:
            raise SagaError(f"correction={correction!r}; valid: {', '.join(SAGA_CORRECTIONS)}")
        if estimator not in SAGA_ESTIMATORS:
            raise SagaError(f"estimator={estimator!r}; valid: {', '.join(SAGA_ESTIMATORS)}")
        if mean_over not in SAGA_MEANS:
            raise SagaError(f"mean_over={mean_over!r}; valid: {', '.join(SAGA_MEANS)}")
        if not (np.isfinite(server_lr) and server_lr > 0):
            raise SagaError(f"server_lr={server_lr!r} must be a finite number > 0")
        if not (np.isfinite(correction_floor) and correction_floor >= 0):
            raise SagaError(f"correction_floor={correction_floor!r} must be a finite number >= 0")
        self.server_lr = server_lr
        self.init = init
        self.estimator = estimator
        self.mean_over = mean_over
        self.correction = correction
        self.correction_floor = float(correction_floor)
        self.memory: SagaMemory | None = None  # sized on the first aggregation
        self._known: dict[str, None] = {}  # devices seen before the memory existed

    def summary(self) -> None:
        log(INFO, "\t├──> FedSAG settings:")
        log(INFO, "\t│\t├── Server learning rate: %s", self.server_lr)
        log(INFO, "\t│\t├── Memory init: %s", self.init)
        log(INFO, "\t│\t├── Estimator: %s", self.estimator)
        log(INFO, "\t│\t├── Memory mean over: %s", self.mean_over)
        if self.correction == "participants":
            weight = "1/|S| (the seed's)"
        elif self.correction_floor:
            weight = f"1/max(|S|, M), M the selection's cap or {self.correction_floor:g}"
        else:
            weight = "1/max(|S|, M), M the selection's cap (1/|S| without one)"
        log(INFO, "\t│\t├── Correction weight: %s", weight)
        rule = self.robust.rule.value
        params = ", ".join(f"{k}={v}" for k, v in self.robust.params().items())
        log(INFO, "\t│\t├── Robust rule: %s%s", rule, f" ({params})" if params else "")
        log(INFO, "\t│\t└── Memory max age: %s", self.max_age or "off")
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` contract, run by EdgeFleet's round loop (see
        :meth:`~edgefleet.loop.base.LoopStrategy.start`)."""
        return start_on_loop(self, grid, initial_arrays, *args, **kwargs)

    def declarations(self) -> list[Declaration]:
        return [Declaration(type(self).__name__, device_memory=True)]

    def register_devices(self, device_ids: Iterable[str]) -> None:
        """Count devices in K before their first upload (the memory mean is over all K;
        a device that never uploaded has a zero memory)."""
        for device_id in device_ids:
            self._known.setdefault(device_id)
            if self.memory is not None:
                self.memory.register(device_id)

    def on_session(self, arrays: ArrayRecord | None) -> None:
        """A new session (sessions wrapper): forget the memories. They are updates of
        another device set against models of the last session, and SAGA's correction
        assumes one fixed set of K devices; keeping them would pull every round of the new
        session towards the old optimum. Devices re-register as they answer."""
        self.memory = None
        self._known = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        # Deltas are taken against the model the devices received.
        current_round().own(self, _Global).arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid = [m for m in replies if not m.has_error()]
        sent = current_round().own(self, _Global).arrays
        if not valid or sent is None:
            return None, None
        like = to_numpy(sent)
        theta = flatten(like)
        if self.memory is None:
            self.memory = SagaMemory(theta.size, init=self.init, mean_over=self.mean_over)
            self.register_devices(list(self._known))
        if self.max_age:
            expired = self.memory.expire(server_round, self.max_age)
            if expired:
                log(INFO, "FedSAG round %d: memories of %s older than %d rounds expired",
                    server_round, ", ".join(expired), self.max_age)  # fmt: skip
                current_round().section(RobustRow).saga_expired = expired
        updates: dict[str, np.ndarray] = {}
        for msg in valid:
            device = reply_device(msg)
            delta = flatten(to_numpy(reply_arrays(msg.content))) - theta
            try:
                self.memory.check({device: delta})
            except SagaError as err:  # e.g. finite float32 models whose difference is not
                log(WARNING, "FedSAG round %d: update of %s dropped: %s", server_round, device, err)
                continue
            updates[device] = delta
        if not updates:
            return None, None
        # Never below SAG's 1/K: a floor above the fleet size would discount fresh
        # information more than keeping every stale memory does.
        fleet = len(set(self.memory.device_ids) | set(updates))
        floor = 0.0
        if self.correction == "channels":
            floor = max(self.correction_floor, float(current_round().participant_cap or 0))
        weight = 1.0 / max(len(updates), min(floor, fleet))
        if self.robust.on:
            current_round().section(RobustRow).robust_rule = self.robust.rule.value
            v = self._robust_direction(self.memory.check(updates), weight)
        else:
            v = self.memory.direction(
                updates, estimator=self.estimator, correction_weight=weight, commit=False
            )
        with np.errstate(over="ignore"):  # an overflow is caught just below
            new = unflatten(theta + self.server_lr * v, like)
        if not all(np.isfinite(a).all() for a in new.values() if a.dtype.kind == "f"):
            # Finite updates can still combine (or round to float32) into inf; a
            # non-finite global model would end every later round, so skip this one.
            log(
                WARNING,
                "FedSAG round %d: the step would make the model non-finite; model and "
                "memory left unchanged",
                server_round,
            )
            return None, None
        self.memory.store(updates, round=server_round)  # replaces the participants' memories
        arrays = to_record(new)
        metrics = aggregate_metricrecords([m.content for m in valid], self.weighted_by_key)
        return arrays, metrics

    def _robust_direction(self, updates: Mapping[str, np.ndarray], weight: float) -> np.ndarray:
        """v = R(memories) + weight x |S| x R(corrections) (module docstring), without
        changing the memory."""
        memory = self.memory
        assert memory is not None
        stored = memory.stored()
        fresh = [i for i in updates if i not in stored] if memory.init == "first-update" else []
        if self.estimator == "sag":
            after = {**stored, **updates}
        else:
            after = {**stored, **{i: updates[i] for i in fresh}}
        fleet = len(set(memory.device_ids) | set(updates))
        zeros = fleet - len(after) if memory.mean_over == "fleet" else 0
        rows = [*after.values(), *([np.zeros(memory.dim)] * zeros)]
        mean = (
            robust_aggregate(self.robust, np.stack(rows)).vector if rows else np.zeros(memory.dim)
        )
        if self.estimator == "sag":
            return mean
        corrections = [
            d - stored.get(i, np.zeros(memory.dim)) for i, d in updates.items() if i not in fresh
        ]
        if not corrections:
            return mean
        pooled = robust_aggregate(self.robust, np.stack(corrections)).vector
        return mean + weight * len(corrections) * pooled

    def state_dict(self) -> dict[str, Any]:
        return {
            "memory": self.memory.state_dict() if self.memory else None,
            "known": list(self._known),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._known = dict.fromkeys(state.get("known", []))
        if state.get("memory") is not None:
            saved = state["memory"]
            self.memory = SagaMemory(int(saved["dim"]), init=self.init, mean_over=self.mean_over)
            self.memory.load_state_dict(saved)


@dataclass
class _Global:
    arrays: ArrayRecord | None = None  # the model this round's train messages carried
