"""Energy-aware age-based device selection (EH-FedSAG, arXiv 2606.18758).

Each round the server takes, among the devices whose battery covers a round (feasible), up
to M (the number of orthogonal uplink channels) with the largest age, the number of rounds
since the device last uploaded; equal ages are ordered at random by the seeded RNG. Age
priority keeps every device with a non-zero harvest rate in the federation: a device that
is feasible only rarely keeps ageing until it outranks the frequent ones.

Two ways to get the same selection:

- :func:`select_by_age`: from the full feasibility map (every online device answered).
- :func:`query_order` + :func:`select_in_batches`: ask devices for their status in
  descending age, a batch at a time, and stop once M feasible ones have answered. The
  status traffic then scales with M, not with the fleet. Both draw the same single number
  from the RNG and order ties by a keyed hash of the device id, so the relative order of
  two devices does not depend on which other devices are present: with equal RNG states
  the batched walk returns exactly the list :func:`select_by_age` returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import numpy as np

from edgefleet.errors import SettingError


class SelectionError(SettingError):
    """Bad input to a selection function; the message names the problem."""


def _tie_keys(ids: list[str], salt: int) -> list[int]:
    # A keyed hash is a uniformly random order of the ids for a random salt, and the key of
    # an id does not depend on the other ids, unlike a permutation drawn for a given list.
    key = salt.to_bytes(8, "little")
    return [
        int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8, key=key).digest(), "little")
        for i in ids
    ]


class SelectionOrder(StrEnum):
    """Energy-age selection's query order (``selection.order``)."""

    AGE = "age"
    RANDOM = "random"


SELECTION_ORDERS: tuple[str, ...] = tuple(m.value for m in SelectionOrder)


def query_order(
    ages: Mapping[str, int],
    candidates: Iterable[str],
    rng: np.random.Generator,
    order: str = "age",
) -> list[str]:
    """``candidates`` by age descending, equal ages in a random order drawn from ``rng``;
    with ``order="random"``, all of them in that random order (ages ignored), so the first
    M feasible ones are a uniform sample of the feasible devices.

    Draws exactly one number from ``rng`` whatever the candidates are.
    """
    if order not in SELECTION_ORDERS:
        raise SelectionError(f"order={order!r} is unknown; valid: {', '.join(SELECTION_ORDERS)}")
    salt = int(rng.integers(0, 2**63))
    ids = sorted(set(candidates))
    missing = [i for i in ids if i not in ages]
    if missing:
        raise SelectionError(
            f"no age for {len(missing)} device(s), e.g. {missing[:3]}; register them first"
        )
    keys = _tie_keys(ids, salt)
    by_age = order == "age"
    ranked = sorted(
        zip(ids, keys, strict=True), key=lambda t: (-ages[t[0]] if by_age else 0, t[1], t[0])
    )
    return [i for i, _ in ranked]


def select_by_age(
    ages: Mapping[str, int],
    feasible: Iterable[str],
    max_devices: int,
    rng: np.random.Generator,
    order: str = "age",
) -> list[str]:
    """Up to ``max_devices`` feasible devices with the largest age, by age descending (or,
    with ``order="random"``, a uniform sample of them)."""
    _check_max(max_devices)
    return query_order(ages, feasible, rng, order)[:max_devices]


def select_in_batches(
    order: list[str],
    is_feasible: Callable[[list[str]], Mapping[str, bool]],
    max_devices: int,
    batch_size: int,
) -> tuple[list[str], int]:
    """Walk ``order`` a batch at a time until ``max_devices`` feasible devices are found.

    ``is_feasible(batch)`` returns feasibility per id; an id missing from its answer is
    unavailable. Returns (selected in ``order``'s order, number of devices queried).
    """
    _check_max(max_devices)
    if batch_size < 1:
        raise SelectionError(f"batch_size={batch_size!r} must be >= 1")
    selected: list[str] = []
    queried = 0
    for start in range(0, len(order), batch_size):
        if len(selected) >= max_devices:
            break
        batch = order[start : start + batch_size]
        answers = is_feasible(batch)
        queried += len(batch)
        selected.extend(i for i in batch if answers.get(i, False))
    return selected[:max_devices], queried


def _check_max(max_devices: int) -> None:
    if max_devices < 0:
        raise SelectionError(f"max_devices={max_devices!r} must be >= 0")


class AgeTracker:
    """Rounds since each device last uploaded, keyed by stable device id.

    After :meth:`on_round`, an uploader's age is 0 and every other tracked device's age has
    grown by one: the age read at selection time is the number of completed rounds since
    the device's last upload. Offline devices keep ageing (age is a matter of time, not of
    presence), so a device that returns is asked early.

    Newcomers first: with ``newcomer_age=None`` (default) a device registered after round r
    starts at age r, as if it had been there from the start and never uploaded, so it ranks
    with the devices that never uploaded, ahead of every device that has. A SAGA server
    wants this: a newcomer's memory is empty (or unknown) until its first upload. The paper
    starts all devices together at age 0, which this reproduces at round 0. An int gives
    every newcomer that fixed age instead.
    """

    def __init__(self, newcomer_age: int | None = None) -> None:
        if newcomer_age is not None and newcomer_age < 0:
            raise SelectionError(f"newcomer_age={newcomer_age!r} must be >= 0 or None")
        self.newcomer_age = newcomer_age
        self.rounds = 0
        self._ages: dict[str, int] = {}

    @property
    def ages(self) -> Mapping[str, int]:
        """Read-only view of the ages."""
        return MappingProxyType(self._ages)

    def register(self, device_ids: Iterable[str]) -> None:
        """Track new devices (known ones keep their age)."""
        start = self.rounds if self.newcomer_age is None else self.newcomer_age
        for i in device_ids:
            self._ages.setdefault(str(i), start)

    def on_round(self, uploaded: Iterable[str], known: Iterable[str] = ()) -> None:
        """Close a round: register ``known`` and ``uploaded`` devices not yet tracked, age
        every tracked device by one, then set the uploaders' ages to 0."""
        up = [str(i) for i in uploaded]
        self.register(known)
        self.register(up)
        for i in self._ages:
            self._ages[i] += 1
        for i in up:
            self._ages[i] = 0
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "newcomer_age": self.newcomer_age, "ages": dict(self._ages)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            rounds = int(state["rounds"])
            ages = {str(k): int(v) for k, v in dict(state["ages"]).items()}
            newcomer = state.get("newcomer_age", self.newcomer_age)
        except (KeyError, TypeError, ValueError) as err:
            raise SelectionError(f"age tracker state is malformed: {err!r}") from None
        if rounds < 0 or any(a < 0 for a in ages.values()):
            raise SelectionError("age tracker state has a negative round count or age")
        self.rounds = rounds
        self._ages = ages
        self.newcomer_age = None if newcomer is None else int(newcomer)
