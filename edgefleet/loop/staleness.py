"""Staleness weights and the FedBuff server step: the pure math of asynchronous aggregation.

In buffered asynchronous FL (FedBuff, Nguyen et al., "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022) devices train on whatever global model was current
when they started, and the server makes a new model every K (``buffer_size``) updates. An
update whose base model is ``s`` versions old (its *staleness*) is discounted by a weight
``w(s)``. The weighting functions are those of FedAsync (Xie, Koyejo and Gupta,
"Asynchronous Federated Optimization", 2019), which FedBuff reuses:

- ``constant``: ``w(s) = 1`` (no discount; FedBuff's buffer alone damps staleness);
- ``polynomial`` (the default): ``w(s) = (1 + s) ** -a``; FedBuff's experiments use
  ``a = 0.5`` (``1 / sqrt(1 + s)``), the default here;
- ``hinge``: ``w(s) = 1`` for ``s <= b``, else ``1 / (a (s - b) + 1)``: no discount for
  updates at most ``b`` versions old, then a hyperbolic one (FedAsync's ``a = 10, b = 4``).

Devices that reply rarely (a board on a slow link) are under-represented in a buffered
asynchronous run: their data enters the model a few times against the fast devices' many.
``participation = "interval"`` multiplies each update by its device's estimated participation
interval, as FedAU does for devices of unknown participation rates (Wang and Ji, "A
Lightweight Method for Tackling Unknown Participation Statistics in Federated Averaging",
ICLR 2024), counted here in versions (:meth:`AsyncSettings.participation_weight`): a device
with 1 update in the ``v`` versions since it joined has interval ``v``; normalised by
``K / n`` (``n`` devices that have sent an update and are connected now, ``K`` updates a
version), so a fleet whose devices reply at equal rates gets 1 everywhere, and one whose
devices come and go is not skewed by the time a device was away or the devices that left;
bounded to [1/cap, cap] (FedAU bounds its estimate too: a device's first updates say little
of its rate).

The server step (FedBuff's Algorithm 1, server side) over the buffer ``B`` is

    x <- x + eta_g * sum_{i in B} n_i w(s_i) delta_i / sum_{i in B} n_i

with ``delta_i`` = the device's model minus the model it was sent (its base). The server
step ``eta_g`` is constant (``server_lr_schedule = "constant"``) or follows a cosine from
``server_lr`` down to ``server_lr_min`` over the run's versions (``"cosine"``,
:meth:`AsyncSettings.server_lr_at`): a large step early reaches a usable model in few
versions, a small one late averages the buffers of a non-IID fleet instead of swinging the
model towards each buffer's devices (docs/how-to/async-aggregation.md). FedBuff's own
normalisation is ``1/K`` with every ``n_i`` equal (its clients all run the same number of
local steps): :func:`fedbuff_step` with equal weights is exactly that, and it is what
EdgeFleet's loop computes with an inner strategy that weights replies equally
(:class:`~edgefleet.strategies.equalweight.EqualWeightFedAvg`). With Flower's ``FedAvg`` inside,
``n_i`` is each reply's ``num-examples``, the FedAvg-family generalisation: a device with
less data moves the model less, as in a synchronous round. The staleness weight multiplies
the update and is deliberately *not* renormalised (dividing by ``sum n_i w_i`` would undo
the discount when every update in a buffer is equally stale).

Nothing here imports Flower: the loop that feeds these functions is
:mod:`edgefleet.loop.asyncloop`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from edgefleet.errors import SettingError

if TYPE_CHECKING:  # (asyncloop imports this module)
    from edgefleet.loop.asyncloop import AsyncConfig


class Staleness(StrEnum):
    """How an update is discounted by its staleness (``async.staleness``)."""

    POLYNOMIAL = "polynomial"
    CONSTANT = "constant"
    HINGE = "hinge"


STALENESS_FUNCTIONS: tuple[str, ...] = tuple(m.value for m in Staleness)
SERVER_LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")
PARTICIPATION_WEIGHTS: tuple[str, ...] = ("none", "interval")


class AsyncSettingError(SettingError):
    """A bad asynchronous-aggregation setting; the message names it and the valid values."""


def staleness_weight(kind: str, s: int, a: float = 0.5, b: int = 4) -> float:
    """``w(s)`` of the module docstring for an update ``s`` >= 0 versions old."""
    if s < 0:
        raise ValueError(f"staleness {s} < 0: an update cannot be based on a future model")
    if kind == Staleness.CONSTANT:
        return 1.0
    if kind == Staleness.POLYNOMIAL:
        return float((1.0 + s) ** -a)
    if kind == Staleness.HINGE:
        return 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0)
    raise AsyncSettingError(f"staleness function {kind!r}; valid: {', '.join(STALENESS_FUNCTIONS)}")


@dataclass(frozen=True)
class AsyncSettings:
    """How the asynchronous loop runs (module docstring of :mod:`edgefleet.loop.
    asyncloop`): ``concurrency`` devices training at once, a new model every ``buffer_size``
    accepted updates, each weighted by ``staleness`` (with ``a``, and ``b`` for hinge), the
    server learning rate ``server_lr`` (constant, or a cosine down to ``server_lr_min`` over
    the run's versions: ``server_lr_schedule``), each update also weighted by its device's
    participation interval (``participation = "interval"``, bounded by
    ``participation_cap``), and updates more than ``max_staleness`` versions old dropped
    (0: none dropped)."""

    concurrency: int = 10
    buffer_size: int = 5
    staleness: str = Staleness.POLYNOMIAL
    a: float = 0.5
    b: int = 4
    server_lr: float = 1.0
    max_staleness: int = 0
    server_lr_schedule: str = "constant"
    server_lr_min: float = 0.0
    participation: str = "none"
    participation_cap: float = 4.0

    @classmethod
    def from_config(cls, cfg: AsyncConfig) -> AsyncSettings:
        """The loop's settings as ``async.*`` sets them."""
        return cls(
            concurrency=cfg.concurrency,
            buffer_size=cfg.buffer_size,
            staleness=cfg.staleness,
            a=cfg.staleness_a,
            b=cfg.staleness_b,
            server_lr=cfg.server_lr,
            max_staleness=cfg.max_staleness,
            server_lr_schedule=cfg.server_lr_schedule,
            server_lr_min=cfg.server_lr_min,
            participation=cfg.participation,
            participation_cap=cfg.participation_cap,
        )

    def __post_init__(self) -> None:
        if self.staleness not in STALENESS_FUNCTIONS:
            raise AsyncSettingError(
                f"staleness {self.staleness!r}; valid: {', '.join(STALENESS_FUNCTIONS)}"
            )
        ints = {"concurrency": 1, "buffer_size": 1, "b": 0, "max_staleness": 0}
        for name, low in ints.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AsyncSettingError(f"{name}={value!r} must be an integer >= {low}")
        if not (math.isfinite(self.a) and self.a >= 0):
            raise AsyncSettingError(f"a={self.a!r} must be a finite number >= 0")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise AsyncSettingError(f"server_lr={self.server_lr!r} must be a finite number > 0")
        if self.server_lr_schedule not in SERVER_LR_SCHEDULES:
            raise AsyncSettingError(
                f"server_lr_schedule {self.server_lr_schedule!r}; valid: "
                f"{', '.join(SERVER_LR_SCHEDULES)}"
            )
        if not (math.isfinite(self.server_lr_min) and 0 <= self.server_lr_min <= self.server_lr):
            raise AsyncSettingError(
                f"server_lr_min={self.server_lr_min!r} must be a finite number from 0 to "
                f"server_lr ({self.server_lr!r}): the cosine schedule decays towards it"
            )

        if self.participation not in PARTICIPATION_WEIGHTS:
            raise AsyncSettingError(
                f"participation {self.participation!r}; valid: {', '.join(PARTICIPATION_WEIGHTS)}"
            )
        if not (math.isfinite(self.participation_cap) and self.participation_cap >= 1):
            raise AsyncSettingError(
                f"participation_cap={self.participation_cap!r} must be a finite number >= 1"
            )

    def participation_weight(
        self, version: int, updates: int, devices: int, since: int = 0
    ) -> float:
        """The multiplier of an update that makes ``version`` from a device whose
        ``updates``-th accepted update it is (this one included) since it joined at version
        ``since``, in a fleet of ``devices`` that have sent one and are connected (module
        docstring): 1 with ``participation = "none"``."""
        if self.participation == "none":
            return 1.0
        if version - since < 1 or updates < 1 or devices < 1 or since < 0:
            raise ValueError(
                f"version {version} since {since}, updates {updates}, devices {devices}: "
                "each >= 1 (version after since)"
            )
        interval = (version - since) / updates
        weight = self.buffer_size * interval / devices
        return float(min(self.participation_cap, max(1.0 / self.participation_cap, weight)))

    def server_lr_at(self, version: int, num_versions: int) -> float:
        """The server step that makes ``version`` (1-based) of a run of ``num_versions``.
        The cosine reaches ``server_lr_min`` one version after the last, so no version's
        step is wasted at 0."""
        if self.server_lr_schedule == "constant" or num_versions < 1:
            return self.server_lr
        done = min(max(version - 1, 0), num_versions) / num_versions
        span = self.server_lr - self.server_lr_min
        return self.server_lr_min + span * 0.5 * (1.0 + math.cos(math.pi * done))

    def weight(self, s: int) -> float:
        return staleness_weight(self.staleness, s, self.a, self.b)

    def too_stale(self, s: int) -> bool:
        return self.max_staleness > 0 and s > self.max_staleness


def fedbuff_step(
    x: Mapping[str, np.ndarray],
    deltas: Sequence[Mapping[str, np.ndarray]],
    num_examples: Sequence[float],
    staleness: Sequence[int],
    settings: AsyncSettings,
) -> dict[str, np.ndarray]:
    """The FedBuff server step of the module docstring, in float64 (the reference the loop's
    composition with an inner strategy is tested against)."""
    if not (len(deltas) == len(num_examples) == len(staleness)) or not deltas:
        raise ValueError("one weight and one staleness per update, and at least one update")
    total = float(sum(num_examples))
    out = {}
    for key, value in x.items():
        step = sum(
            n * settings.weight(s) * np.asarray(d[key], dtype=np.float64)
            for d, n, s in zip(deltas, num_examples, staleness, strict=True)
        )
        out[key] = np.asarray(value, dtype=np.float64) + settings.server_lr * step / total
    return out


def summarise(staleness: Sequence[int]) -> dict[str, float | int | None]:
    """Min, median and max of a version's staleness values (None when it had none)."""
    if not staleness:
        return {"staleness_min": None, "staleness_median": None, "staleness_max": None}
    return {
        "staleness_min": int(min(staleness)),
        "staleness_median": float(np.median(staleness)),
        "staleness_max": int(max(staleness)),
    }
