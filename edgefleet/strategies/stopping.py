"""Stopping rules: data-free (from the global task vector) and validation-based.

``TaskVectorStopping`` is the rule of "Beyond Fixed Rounds: Data-Free Early Stopping for
Practical Federated Learning" (arXiv 2601.22669). It watches only the global model: the task
vector v_r = theta_r - theta_0 grows fast while the federation learns and stalls once it
has converged (or never takes off with a learning rate far too low), so the run stops when
the relative growth of ||v_r|| stays below ``tau`` for ``patience`` rounds in a row. It
needs no data on the server. Choose it whenever the server must not hold data.

``ValidationStopping`` is the baseline that paper compares against: patience on the
accuracy of a validation set held by the server. It exists for comparison only: a server
that holds validation data breaks the premise of federated learning.

Squared norm (``norm = "squared"``): g' = (d_r^2 - d_{r-1}^2) / d_{r-1}^2 = (1 + g)^2 - 1,
about 2g for small g, so a threshold tau on the plain norm corresponds to about 2 tau on the
squared norm (tau' = (1 + tau)^2 - 1 exactly).

Form (``form``, run-config ``stopping.form``): ``"reference"`` (default) is the reference
code's rule above, the counter counting rounds *in a row* below ``tau`` (a round of growth
resets it), on the norm ``stopping.norm`` names. ``"seed"`` is the rule as the paper's seed
text writes it: the squared norm d_r = ||theta_r - theta_0||^2 and a counter of the rounds
with g_r < tau that is never reset (the text describes no reset), so the rule fires at the
``patience``-th slow round, in a row or not. The two changes pull opposite ways: the squared
norm halves the effective tau (later), the missing reset counts scattered slow rounds
(earlier); measured on PneumoniaMNIST and BCCD at tau 0.005 the seed's form stopped about 20
rounds later (docs/explanation/field-baselines.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgefleet.algorithms.stopping import (
    FORMS,
    NORMS,
    VALIDATION_RULES,
    PlateauCounter,
    StoppingForm,
    ValidationPatience,
    difference_norm,
)
from edgefleet.arrays import to_numpy, to_record
from edgefleet.errors import SettingError
from edgefleet.loop.base import LoopStrategy
from edgefleet.loop.context import StoppingRow, ValidationRow
from edgefleet.loop.roundloop import RoundCallback, RoundResult
from edgefleet.loop.status import Ask
from edgefleet.settings import at_least, checked, choice, open_fraction, setting

STOP_PLATEAU = "task-vector-plateau"
STOP_DIVERGED = "diverged"
STOP_VALIDATION = "validation-plateau"


def task_vector_norm(
    theta: ArrayRecord, theta0: ArrayRecord, keys: Iterable[str], squared: bool = False
) -> float:
    """||theta - theta0|| over the arrays named in ``keys`` (the trainable parameters)."""
    keys = list(keys)
    return difference_norm(_float64(theta, keys), _float64(theta0, keys), squared)


def _float64(arrays: ArrayRecord, keys: Iterable[str]) -> dict[str, np.ndarray]:
    # Array.numpy() decodes the bytes on every call: decode once, in float64 for the sum.
    return {k: arrays[k].numpy().astype(np.float64) for k in keys}


def trainable_keys(arrays: ArrayRecord) -> list[str]:
    """Floating-point arrays other than BatchNorm statistics: PyTorch's trainable tensors
    for the models here. Pass explicit keys to the stopper for other models."""
    stats = ("running_mean", "running_var", "num_batches_tracked")
    return [k for k, a in arrays.items() if not k.endswith(stats) and np.dtype(a.dtype).kind == "f"]


class TaskVectorStopping(LoopStrategy, RoundCallback):
    """Data-free early stopping (arXiv 2601.22669) around any inner strategy.

    After every round: d_r = ||theta_r - theta_0|| (``norm="l2"``, the reference code's
    choice, or ``"squared"``), growth g_r and a patience counter (:class:`PlateauCounter`);
    the run stops at the first round where the counter reaches ``patience`` (reason
    ``task-vector-plateau``), or at once if the global model holds NaN or inf (reason
    ``diverged``). A round in which no update was aggregated carries no information about
    growth (the model did not move because nobody trained, not because training
    converged): it neither counts towards patience nor resets the counter.
    :meth:`restart` starts over from a new theta_0 (a new session). With
    ``enforce=False`` it only records (``task_vector_norm``, ``task_vector_growth`` and
    ``plateau_count`` in each metrics row) and never stops the run.
    """

    @classmethod
    def from_config(
        cls, inner: Strategy, cfg: StoppingConfig, keys: list[str] | None = None
    ) -> TaskVectorStopping:
        """The data-free rule as ``stopping.*`` sets it: it stops the run under ``data-free``
        and only records its signal under ``observe``."""
        checked(
            cfg,
            "stopping.mode",
            cfg.mode,
            (StoppingMode.DATA_FREE, StoppingMode.OBSERVE),
            cls.__name__,
        )
        enforce = cfg.mode == StoppingMode.DATA_FREE
        return cls(inner, cfg.tau, cfg.patience, cfg.norm, keys, enforce, cfg.form)

    def __init__(
        self,
        inner: Strategy,
        tau: float = 0.005,
        patience: int = 10,
        norm: str = "l2",
        keys: list[str] | None = None,
        enforce: bool = True,
        form: str = "reference",
    ) -> None:
        """``form="seed"``: the squared norm and a counter never reset (module docstring);
        ``norm`` is then not used."""
        super().__init__(inner)
        self.enforce = enforce
        if norm not in NORMS:
            raise SettingError(f"norm {norm!r}: must be one of {', '.join(NORMS)}")
        if form not in FORMS:
            raise SettingError(f"form {form!r}: must be one of {', '.join(FORMS)}")
        if patience < 1:
            raise ValueError(f"patience {patience}: must be >= 1")
        self.form = form
        seed = form == StoppingForm.SEED
        self.rule = PlateauCounter(tau=tau, patience=patience, reset_on_growth=not seed)
        self.squared = seed or norm == "squared"
        self.keys = keys
        self.theta0: dict[str, np.ndarray] | None = None  # float64, the keys watched only
        # Under sessions a plateau ends the session's training, not the run: the devices
        # rest (no train messages) until the next session restarts the rule.
        self.in_sessions = False
        self.holding = False  # auxiliary rounds of a session start: not the session's training
        self.resting = False

    def on_session(self, arrays: ArrayRecord | None) -> None:
        super().on_session(arrays)
        self.in_sessions = True
        self.holding = arrays is None
        self.resting = False  # a new session trains again (its auxiliary rounds too)
        if arrays is not None:
            self.restart(arrays)

    def plan_status(
        self, server_round: int, arrays: ArrayRecord, nodes: Sequence[int], ask: Ask
    ) -> None:
        """A resting fleet is not asked (selection inside spends no status queries)."""
        if not self.resting:
            super().plan_status(server_round, arrays, nodes, ask)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.resting:
            return []
        return super().configure_train(server_round, arrays, config, grid)

    def settings(self) -> dict[str, object]:
        return {
            "Growth threshold (tau)": self.rule.tau,
            "Patience": self.rule.patience,
            "Norm": "squared" if self.squared else "l2",
            "Form": self.form,
            "Stops the run": self.enforce,
        }

    def on_start(self, arrays: ArrayRecord, first_round: int) -> None:
        if self.theta0 is None:  # a resumed run keeps the theta_0 it had
            self.restart(arrays)

    def restart(self, theta0: ArrayRecord) -> None:
        self.theta0 = _float64(theta0, self.keys or trainable_keys(theta0))
        self.rule.reset()
        self.resting = False

    def after_round(self, result: RoundResult) -> str | None:
        assert self.theta0 is not None, "on_start was not called"
        row = result.context.section(StoppingRow)
        if self.holding or self.resting:
            row.stopping_resting = self.resting
            return None
        theta = _float64(result.arrays, self.theta0)
        if not all(np.isfinite(v).all() for v in theta.values()):
            row.task_vector_norm = math.nan
            return STOP_DIVERGED if self.enforce else None
        if not result.participants:
            return None  # the model did not move: no growth to measure
        norm = difference_norm(theta, self.theta0, self.squared)
        fired = self.rule.update(norm)
        row.task_vector_norm = norm
        row.task_vector_growth = self.rule.growth[-1]
        row.plateau_count = self.rule.counter
        # Each round's growth beside tau, so that tau can be tuned from the log.
        growth = self.rule.growth[-1]
        log(
            INFO,
            "Round %d: task vector growth %s (tau %g), plateau %d/%d",
            result.round,
            "-" if growth is None else f"{growth:.4g}",
            self.rule.tau,
            self.rule.counter,
            self.rule.patience,
        )
        if fired and self.enforce and self.in_sessions:
            self.resting = True
            log(INFO, "Round %d: task vector plateau; resting until the next session", result.round)
            return None
        return STOP_PLATEAU if fired and self.enforce else None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rule"] = self.rule.state_dict()
        state["theta0"] = self.theta0
        state["flags"] = [self.in_sessions, self.holding, self.resting]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rule.load_state_dict(state["rule"])
        self.theta0 = state.get("theta0")
        self.in_sessions, self.holding, self.resting = state.get("flags", [False] * 3)


class StoppingMode(StrEnum):
    """When training stops (``stopping.mode``); ``observe`` records both rules' signals every
    round and never stops (for benchmarks)."""

    OFF = "off"
    DATA_FREE = "data-free"
    VALIDATION = "validation"
    OBSERVE = "observe"


STOPPING_MODES: tuple[str, ...] = tuple(m.value for m in StoppingMode)


class ValidationSplit(StrEnum):
    """Where the validation rule's data comes from (``stopping.validation-split``)."""

    OFFICIAL = "official"
    TEST = "test"


VALIDATION_SPLITS: tuple[str, ...] = tuple(m.value for m in ValidationSplit)


@dataclass(frozen=True)
class StoppingConfig:
    """``stopping.*``: data-free early stopping (or the validation baseline)."""

    mode: str = setting(
        "stopping.mode",
        "off",
        choice(STOPPING_MODES),
        "`off`, `data-free`, `validation` (baseline, needs server data), `observe` (record "
        "both, never stop)",
    )
    tau: float = setting("stopping.tau", 0.005, at_least(0.0), "growth threshold")
    patience: int = setting("stopping.patience", 10, at_least(1), "rounds in a row below it")
    norm: str = setting(
        "stopping.norm",
        "l2",
        choice(NORMS),
        "`l2` or `squared` (then use tau' = (1+tau)^2 - 1, about 2 tau)",
    )
    form: str = setting(
        "stopping.form",
        "reference",
        choice(FORMS),
        "`reference` (the reference code's rule: patience counts rounds in a row, on "
        "`stopping.norm`) or `seed` (the seed's: squared norm, a counter never reset)",
    )
    validation_rule: str = setting(
        "stopping.validation-rule",
        "reference",
        choice(VALIDATION_RULES),
        "the validation baseline's rule: `reference` (the paper's: patience on validation "
        "loss and accuracy improving by more than `stopping.validation-min-delta`, ends with "
        "the stop round's model) or `best` (patience after the best accuracy, keeps that model)",
    )
    validation_min_delta: float = setting(
        "stopping.validation-min-delta",
        0.005,
        at_least(0.0),
        "the `reference` rule's minimum improvement of validation loss or accuracy",
    )
    validation_split: str = setting(
        "stopping.validation-split",
        "official",
        choice(VALIDATION_SPLITS),
        "the baselines' validation data: `official` (the data set's own validation split where "
        "it has one, PneumoniaMNIST; else as `test`) or `test` (a held-out share of the "
        "central test set, `stopping.validation-fraction`)",
    )
    validation_fraction: float = setting(
        "stopping.validation-fraction",
        0.5,
        open_fraction,
        "share of the central test set held out for `validation`/`observe`",
    )


class ValidationStopping(LoopStrategy, RoundCallback):
    """Baseline for comparison only: stop when validation figures stop improving
    (:class:`ValidationPatience`; ``rule="best"`` also remembers the best model in
    ``best_arrays``/``best_round``).

    ``validate`` maps the global model to its validation accuracy, or to a mapping with
    ``accuracy`` and ``loss``, on data the *server* holds, which a federated deployment
    should not have; EdgeFleet uses it to measure the data-free rule. Each row records
    ``validation_accuracy`` (and ``validation_loss``). With ``enforce=False`` it never stops.
    """

    @classmethod
    def from_config(cls, inner: Strategy, cfg: StoppingConfig, validate: Any) -> ValidationStopping:
        """The validation baseline as ``stopping.*`` sets it: it stops the run under
        ``validation`` and only records its signal under ``observe``."""
        checked(
            cfg,
            "stopping.mode",
            cfg.mode,
            (StoppingMode.VALIDATION, StoppingMode.OBSERVE),
            cls.__name__,
        )
        enforce = cfg.mode == StoppingMode.VALIDATION
        rule, delta = cfg.validation_rule, cfg.validation_min_delta
        return cls(inner, validate, cfg.patience, enforce, rule, delta)

    def __init__(
        self,
        inner: Strategy,
        validate: Any,
        patience: int = 10,
        enforce: bool = True,
        rule: str = "reference",
        min_delta: float = 0.005,  # stopping.validation-min-delta's default: one rule, one value
    ) -> None:
        super().__init__(inner)
        self.enforce = enforce
        self.validate = validate
        self.counter = ValidationPatience(rule, patience, min_delta)
        self.best_arrays: ArrayRecord | None = None

    @property
    def best_round(self) -> int:
        return self.counter.best_round

    @property
    def keeps_best(self) -> bool:
        """Whether the run's result is the best model (rule "best") or the last one."""
        return self.counter.rule == "best"

    def settings(self) -> dict[str, object]:
        return {
            "Rule": self.counter.rule,
            "Patience": self.counter.patience,
            "Minimum improvement": self.counter.min_delta,
            "Stops the run": self.enforce,
        }

    def after_round(self, result: RoundResult) -> str | None:
        figures = self.validate(result.arrays)
        if isinstance(figures, Mapping):
            accuracy, loss = float(figures["accuracy"]), figures.get("loss")
        else:
            accuracy, loss = float(figures), None
        row = result.context.section(ValidationRow)
        row.validation_accuracy = accuracy
        if loss is not None:
            loss = float(loss)
            row.validation_loss = loss
        if isinstance(figures, Mapping) and "balanced_accuracy" in figures:
            row.validation_balanced_accuracy = float(figures["balanced_accuracy"])
        if self.keeps_best and accuracy > self.counter.best_accuracy:
            self.best_arrays = result.arrays
        fired = self.counter.update(result.round, accuracy, loss)
        return STOP_VALIDATION if fired and self.enforce else None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            counter=self.counter.state_dict(),
            best_arrays=None if self.best_arrays is None else to_numpy(self.best_arrays),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.counter.load_state_dict(state["counter"])
        best = state["best_arrays"]
        self.best_arrays = None if best is None else to_record(best)
