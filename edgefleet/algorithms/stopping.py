"""The stopping rules as plain counting rules on per-round figures (no Flower import).

:class:`PlateauCounter` is data-free stopping's rule on the task vector's norms (arXiv
2601.22669; :class:`~edgefleet.strategies.stopping.TaskVectorStopping` feeds it),
:class:`ValidationPatience` the validation baseline's rule
(:class:`~edgefleet.strategies.stopping.ValidationStopping`). The module docstring of
:mod:`edgefleet.strategies.stopping` says when to choose which form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np


class StoppingNorm(StrEnum):
    """The task vector's norm (``stopping.norm``)."""

    L2 = "l2"
    SQUARED = "squared"


NORMS: tuple[str, ...] = tuple(m.value for m in StoppingNorm)


class StoppingForm(StrEnum):
    """The data-free rule's form (``stopping.form``; the module docstring)."""

    REFERENCE = "reference"
    SEED = "seed"


FORMS: tuple[str, ...] = tuple(m.value for m in StoppingForm)


def difference_norm(
    theta: dict[str, np.ndarray], theta0: dict[str, np.ndarray], squared: bool
) -> float:
    """||theta - theta0|| (its square when ``squared``), summed in float64 over theta's keys."""
    total = 0.0
    for key, value in theta.items():
        diff = (value - theta0[key]).ravel()
        total += float(np.dot(diff, diff))
    return total if squared else math.sqrt(total)


# The rule needs only the last growth; a few more are kept for a reader. A bound, because a
# fleet that runs for days (an asynchronous run makes a version every few replies) would
# otherwise grow the list, and every checkpoint with it, without end.
GROWTH_KEPT = 64


@dataclass
class PlateauCounter:
    """The counting rule on a sequence of task-vector norms d_1, d_2, ...

    g_r = (d_r - d_{r-1}) / d_{r-1} for r >= 2; the counter grows by one while g_r < tau
    and resets to zero when g_r >= tau; the rule fires when the counter reaches patience.
    d_{r-1} = 0 (theta_1 equal to theta_0): any growth from zero is infinite growth (reset),
    no growth from zero is none (count). ``reset=False`` (the seed's form): a round of
    growth leaves the counter as it is, so it counts every slow round so far.
    """

    tau: float = 0.005
    patience: int = 10
    previous: float | None = None
    counter: int = 0
    growth: list[float | None] = field(default_factory=list)
    reset_on_growth: bool = True

    def update(self, norm: float) -> bool:
        """Feed d_r; True when the rule fires."""
        g: float | None = None
        if self.previous is not None:
            if self.previous > 0:
                g = (norm - self.previous) / self.previous
            else:
                g = math.inf if norm > 0 else 0.0
            if g < self.tau:
                self.counter += 1
            elif self.reset_on_growth:
                self.counter = 0
        self.previous = norm
        self.growth.append(g)
        del self.growth[:-GROWTH_KEPT]
        return self.counter >= self.patience

    def reset(self) -> None:
        self.previous, self.counter = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"previous": self.previous, "counter": self.counter, "growth": list(self.growth)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous, self.counter = state["previous"], state["counter"]
        self.growth = list(state["growth"])[-GROWTH_KEPT:]


class ValidationRule(StrEnum):
    """Which model the validation rule keeps (``stopping.validation-rule``)."""

    REFERENCE = "reference"
    BEST = "best"


VALIDATION_RULES: tuple[str, ...] = tuple(m.value for m in ValidationRule)


@dataclass
class ValidationPatience:
    """The validation baseline's counting rule, on per-round validation figures.

    ``rule = "reference"`` (the stopping paper's reference code): a round improves when its
    validation accuracy beats the reference accuracy by more than ``min_delta`` *or* its
    validation loss falls below the reference loss by more than ``min_delta``; a figure's
    reference moves only on such an improvement (as Keras's ``min_delta``), so a slow creep
    of small gains does not keep the run alive. The counter resets on an improvement, else
    grows by one, and the rule fires when it reaches ``patience``. The run ends with the
    model of the stop round.

    ``rule = "best"`` (EdgeFleet's earlier baseline): stop ``patience`` rounds after the round
    of the best validation accuracy, and keep that best model.
    """

    rule: str = "reference"
    patience: int = 10
    min_delta: float = 0.0
    best_accuracy: float = -math.inf  # the highest accuracy seen, and its round
    best_round: int = 0
    ref_accuracy: float = -math.inf  # the reference rule's figures to beat
    ref_loss: float = math.inf
    counter: int = 0

    def __post_init__(self) -> None:
        if self.rule not in VALIDATION_RULES:
            raise ValueError(f"rule {self.rule!r}: must be one of {', '.join(VALIDATION_RULES)}")
        if self.patience < 1:
            raise ValueError(f"patience {self.patience}: must be >= 1")

    def update(self, rnd: int, accuracy: float, loss: float | None = None) -> bool:
        """Feed round ``rnd``'s validation figures; True when the rule fires."""
        if accuracy > self.best_accuracy:
            self.best_accuracy, self.best_round = accuracy, rnd
        if self.rule == "best":
            return rnd - self.best_round >= self.patience
        better_acc = accuracy > self.ref_accuracy + self.min_delta
        better_loss = loss is not None and loss < self.ref_loss - self.min_delta
        if better_acc:
            self.ref_accuracy = accuracy
        if better_loss:
            self.ref_loss = loss  # type: ignore[assignment]
        self.counter = 0 if better_acc or better_loss else self.counter + 1
        return self.counter >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_accuracy": self.best_accuracy,
            "best_round": self.best_round,
            "ref_accuracy": self.ref_accuracy,
            "ref_loss": self.ref_loss,
            "counter": self.counter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_accuracy = float(state["best_accuracy"])
        self.best_round = int(state["best_round"])
        self.ref_accuracy = float(state.get("ref_accuracy", -math.inf))
        self.ref_loss = float(state.get("ref_loss", math.inf))
        self.counter = int(state.get("counter", 0))
