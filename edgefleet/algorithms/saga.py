"""SAGA server memory for EH-FedSAG ("EH-FedSAG: Variance-Reduced Federated Learning with
Energy-Aware Participation in Energy-Harvesting IoT", arXiv 2606.18758).

The server keeps one memory vector m_k per device k (its last update, keyed by the stable
device id so a reconnecting node keeps it). With S the round's participants and K the fleet
size, the direction is

    v = (1/K) sum_k m_k  +  w sum_{k in S} (delta_k - m_k)

with the correction weight w = 1/|S| in the seed's form (:class:`~edgefleet.strategies.
fedsag.FedSAG` takes 1/max(|S|, M) by default, M the devices a round has room for), and then
m_k <- delta_k for k in S; the global step is theta <- theta + server_lr * v. Under
partial participation the first term carries every absent device's last known update, so
the average does not swing with who happened to be charged. With every device
participating and every memory filled, v is the plain mean of the deltas (FedAvg). Choose
it over FedAvg when participation is scarce and uneven and the data non-IID.

Memory initialisation (``init``):

- ``"zeros"`` (default): every memory starts at zero. The first round is then exactly
  FedAvg over its participants, and an absent device contributes nothing until it has
  uploaded once. This is the usual choice in the SAGA-type federated methods (FedVARP
  starts its table at zero); the text of arXiv 2606.18758 available to us did not say.
- ``"first-update"``: a device's memory is set to its delta the first time it
  participates, and in that round its correction term is zero (as if its memory had
  already equalled its delta); the memory mean includes it from that round on.

Expiry (``max_age`` in :class:`~edgefleet.strategies.fedsag.FedSAG`): each memory is stamped
with the round it was stored in; :meth:`SagaMemory.expire` drops the memories older than a
number of rounds from the table and the sum (the device stays registered, with the zero
memory, so under ``mean_over="fleet"`` it still counts in K). A device that uploaded one
poisoned update and then stays away would otherwise keep it in the mean for as long as it
is gone.

Cost: the mean of the memories is a running sum (add new minus old on replace), so a round
costs O(|S| x D) whatever K is. Memory: the table holds one row per device that has
uploaded (a device that never did has the zero memory, or none under first-update, and
no row). At SmallCNN size (~420k parameters) 10,000 devices take 10,000 x 420k x 4 bytes =
16.8 GB in float32, twice that in float64, so the table defaults to float32; the running sum
and the returned direction are float64. ``nbytes`` reports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from edgefleet.errors import SettingError


class SagaInit(StrEnum):
    """A device's SAGA memory before its first upload (``saga.init``)."""

    ZEROS = "zeros"
    FIRST_UPDATE = "first-update"


SAGA_INITS: tuple[str, ...] = tuple(m.value for m in SagaInit)


# "saga": v = mean(m) + mean over participants of (delta - m), unbiased (the form);
# "sag": v = mean(m) after the participants' memories are replaced, i.e. the corrections
# enter with weight 1/K instead of 1/P: biased towards stale memories, far lower variance.
class SagaEstimator(StrEnum):
    """The variance-reduced estimator (``saga.estimator``)."""

    SAGA = "saga"
    SAG = "sag"


SAGA_ESTIMATORS: tuple[str, ...] = tuple(m.value for m in SagaEstimator)


# What the memory mean divides by: "stored", the devices that have a memory (the seed's
# wording); "fleet", all K registered devices, a device that never uploaded counting as zero.
class SagaMean(StrEnum):
    """What the memory mean averages over (``saga.mean``)."""

    STORED = "stored"
    FLEET = "fleet"


SAGA_MEANS: tuple[str, ...] = tuple(m.value for m in SagaMean)


# The weight of each correction (delta - m) in the SAGA direction: "participants", 1/|S|
# (the seed's); "channels", 1/max(|S|, M) with M the devices a round has room for (EH-FedSAG's
# uplink channels), so a round that few devices could afford does not inflate its corrections.
class SagaCorrection(StrEnum):
    """The corrections' weight (``saga.correction``)."""

    CHANNELS = "channels"
    PARTICIPANTS = "participants"


SAGA_CORRECTIONS: tuple[str, ...] = tuple(m.value for m in SagaCorrection)


class SagaError(SettingError):
    """Bad input to the SAGA memory; the message names the problem."""


def flatten(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Concatenate the arrays, in key order, into one float64 vector."""
    if not arrays:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays.values()])


def unflatten(vec: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Split ``vec`` into arrays with the keys, order, shapes and dtypes of ``like``.

    Integer and bool arrays (BatchNorm's ``num_batches_tracked``) are rounded, not truncated.
    """
    total = sum(int(np.asarray(a).size) for a in like.values())
    if vec.ndim != 1 or vec.size != total:
        raise SagaError(f"vector of shape {vec.shape} does not fit arrays of {total} entries")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for key, a in like.items():
        ref = np.asarray(a)
        part = vec[offset : offset + ref.size].reshape(ref.shape)
        offset += ref.size
        if ref.dtype.kind in "iub":
            part = np.rint(part)
        out[key] = part.astype(ref.dtype)
    return out


@dataclass(frozen=True)
class _Plan:
    """A round's memory update, worked out before anything is changed."""

    stored: dict[str, np.ndarray]  # device -> its new memory, as the table will hold it
    fresh: list[str]  # first-update newcomers (their correction is zero)
    sum_after: np.ndarray
    devices_after: int
    rows_after: int


class SagaMemory:
    """One memory vector per device over a flat parameter vector of length ``dim``.

    ``num_devices`` (K) counts the registered devices; :meth:`direction` registers
    participants it has not seen, so K grows as devices appear. The mean is over all K
    registered devices, also those offline now.
    """

    def __init__(
        self,
        dim: int,
        init: str = "zeros",
        dtype: Any = np.float32,
        initial_rows: int = 16,
        mean_over: str = "fleet",
    ) -> None:
        if dim < 0:
            raise SagaError(f"dim={dim!r} must be >= 0")
        if init not in SAGA_INITS:
            raise SagaError(f"init={init!r} is unknown; valid: {', '.join(SAGA_INITS)}")
        if mean_over not in SAGA_MEANS:
            raise SagaError(f"mean_over={mean_over!r} is unknown; valid: {', '.join(SAGA_MEANS)}")
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise SagaError(f"dtype={dt} is unsupported; valid: float32, float64")
        self.dim = int(dim)
        self.init = init
        self.mean_over = mean_over
        self.dtype = dt
        self._devices: dict[str, None] = {}  # registered ids, in registration order
        self._row: dict[str, int] = {}  # id -> row of the table, for devices with a memory
        self._stamp: dict[str, int] = {}  # id -> the round its memory was stored in
        # np.zeros asks the OS for zeroed pages lazily: rows not yet written cost nothing.
        self._table = np.zeros((max(1, initial_rows), self.dim), dtype=dt)
        self._sum = np.zeros(self.dim, dtype=np.float64)

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def device_ids(self) -> list[str]:
        return list(self._devices)

    @property
    def nbytes(self) -> int:
        """Bytes held: the table rows in use plus the running sum."""
        return len(self._row) * self.dim * self.dtype.itemsize + self._sum.nbytes

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved for the table (grown by doubling) plus the running sum."""
        return int(self._table.nbytes) + self._sum.nbytes

    def register(self, device_id: str) -> None:
        """Add a device with an empty (zero) memory; K grows by one. Known ids are kept."""
        self._devices.setdefault(str(device_id), None)

    def has_memory(self, device_id: str) -> bool:
        """Whether the device has uploaded at least once."""
        return str(device_id) in self._row

    def memory(self, device_id: str) -> np.ndarray:
        """A copy of the device's memory (zeros before its first upload)."""
        if device_id not in self._devices:
            raise SagaError(f"device {device_id!r} is not registered")
        row = self._row.get(device_id)
        if row is None:
            return np.zeros(self.dim, dtype=self.dtype)
        return self._table[row].copy()

    def mean(self) -> np.ndarray:
        """Mean of the memories (over the stored ones or all K, per ``mean_over``), from
        the running sum."""
        return self._mean_of(self._sum, len(self._devices), len(self._row))

    def recompute_mean(self) -> np.ndarray:
        """The mean re-reduced from the table (O(K x D)); for tests and checks."""
        total = np.zeros(self.dim, dtype=np.float64)
        for start in range(0, len(self._row), 256):  # chunks: a float64 copy of 10,000
            chunk = self._table[start : min(start + 256, len(self._row))]  # rows is 31 GB
            total += chunk.astype(np.float64).sum(axis=0)
        return self._mean_of(total, len(self._devices), len(self._row))

    def stored(self) -> dict[str, np.ndarray]:
        """Every stored memory as a float64 copy, by device id (O(rows x D))."""
        return {i: self._table[r].astype(np.float64) for i, r in self._row.items()}

    def stamp(self, device_id: str) -> int | None:
        """The round the device's memory was stored in (None: no memory, or not known)."""
        return self._stamp.get(device_id)

    def expire(self, now: int, max_age: int) -> list[str]:
        """Drop every memory stored more than ``max_age`` rounds before round ``now``
        (``now - stamp > max_age``); the devices dropped, in row order. A memory without a
        stamp (a checkpoint from before stamps) is stamped ``now``."""
        if max_age < 1:
            raise SagaError(f"max_age={max_age!r} must be >= 1")
        old = []
        for device_id in sorted(self._row, key=self._row.__getitem__):
            if now - self._stamp.setdefault(device_id, now) > max_age:
                old.append(device_id)
        for device_id in old:
            self._remove(device_id)
        return old

    def _remove(self, device_id: str) -> None:
        row = self._row.pop(device_id)
        self._stamp.pop(device_id, None)
        self._sum = self._sum - self._table[row].astype(np.float64)
        last = len(self._row)  # the table's last used row, moved into the freed one
        if row != last:
            moved = next(i for i, r in self._row.items() if r == last)
            self._table[row] = self._table[last]
            self._row[moved] = row
        self._table[last] = 0
        if not self._row:
            self._sum = np.zeros(self.dim, dtype=np.float64)  # no rounding residue left

    def check(self, updates: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The updates as float64 vectors, or a :class:`SagaError` naming the first device
        whose delta has the wrong shape, a non-finite entry, or an entry the table's dtype
        cannot hold (a finite float64 delta beyond float32's range would be stored as inf
        and poison the running sum)."""
        limit = float(np.finfo(self.dtype).max)
        deltas: dict[str, np.ndarray] = {}
        for device_id, delta in updates.items():
            d = np.asarray(delta, dtype=np.float64)
            if d.shape != (self.dim,):
                raise SagaError(
                    f"device {device_id!r}: delta of shape {d.shape}, expected ({self.dim},)"
                )
            if not np.all(np.isfinite(d)):
                # One NaN in the running sum would poison every later round.
                raise SagaError(f"device {device_id!r}: delta has non-finite entries")
            if d.size and float(np.max(np.abs(d))) > limit:
                raise SagaError(
                    f"device {device_id!r}: delta exceeds the {self.dtype.name} memory's range"
                )
            deltas[str(device_id)] = d
        return deltas

    def direction(
        self,
        updates: Mapping[str, np.ndarray],
        *,
        estimator: str = "saga",
        correction_weight: float | None = None,
        commit: bool = True,
        round: int | None = None,
    ) -> np.ndarray:
        """The round's direction v from the participants' deltas; replaces their memories
        (unless ``commit=False``, which leaves the memory exactly as it was).

        ``updates`` maps device id -> flat delta (local model minus global). No participant
        gives the zero vector (model unchanged). ``estimator="saga"``: v = memory mean +
        ``correction_weight`` x the sum of the participants' corrections (delta - m), the
        weight defaulting to 1/|S|; ``"sag"``: v = the memory mean after the participants'
        memories are replaced (``correction_weight`` does not apply).
        """
        if estimator not in SAGA_ESTIMATORS:
            raise SagaError(f"estimator={estimator!r}; valid: {', '.join(SAGA_ESTIMATORS)}")
        deltas = self.check(updates)
        if not deltas:
            return np.zeros(self.dim, dtype=np.float64)
        plan = self._plan(deltas)
        if estimator == "sag":
            v = self._mean_of(plan.sum_after, plan.devices_after, plan.rows_after)
        else:
            # A first-update newcomer's memory is its delta before v is formed, so the mean
            # already counts it and its correction is exactly zero (it is skipped).
            base = self._sum.copy()
            for device_id in plan.fresh:
                base += plan.stored[device_id]
            mean = self._mean_of(base, plan.devices_after, len(self._row) + len(plan.fresh))
            correction = np.zeros(self.dim, dtype=np.float64)
            for device_id, d in deltas.items():
                if device_id in plan.fresh:
                    continue
                row = self._row.get(device_id)
                if row is None:  # zeros init, first upload: the memory is zero
                    correction += d
                else:
                    correction += d - self._table[row].astype(np.float64)
            weight = 1.0 / len(deltas) if correction_weight is None else float(correction_weight)
            v = mean + weight * correction
        if commit:
            self._commit(plan, round)
        return v

    def store(self, updates: Mapping[str, np.ndarray], round: int | None = None) -> None:
        """Replace the participants' memories by their deltas (what :meth:`direction` does
        after forming v), e.g. once a direction got with ``commit=False`` has been used;
        ``round`` stamps them (for :meth:`expire`)."""
        deltas = self.check(updates)
        if deltas:
            self._commit(self._plan(deltas), round)

    def _mean_of(self, total: np.ndarray, devices: int, rows: int) -> np.ndarray:
        count = rows if self.mean_over == "stored" else devices
        if count == 0:
            return np.zeros(self.dim, dtype=np.float64)
        return total / count

    def _plan(self, deltas: Mapping[str, np.ndarray]) -> _Plan:
        """What storing ``deltas`` would do, computed without changing anything."""
        stored = {i: d.astype(self.dtype).astype(np.float64) for i, d in deltas.items()}
        fresh = (
            [i for i in deltas if i not in self._row] if self.init == "first-update" else []
        )  # a list, not a set: sums are added in a fixed order
        total = self._sum.copy()
        for device_id, value in stored.items():
            row = self._row.get(device_id)
            if row is not None:
                total -= self._table[row].astype(np.float64)
            total += value
        new_devices = sum(1 for i in deltas if i not in self._devices)
        new_rows = sum(1 for i in deltas if i not in self._row)
        return _Plan(
            stored=stored,
            fresh=fresh,
            sum_after=total,
            devices_after=len(self._devices) + new_devices,
            rows_after=len(self._row) + new_rows,
        )

    def _commit(self, plan: _Plan, round: int | None = None) -> None:
        for device_id, value in plan.stored.items():
            self.register(device_id)
            if round is not None:
                self._stamp[device_id] = int(round)
            row = self._row.get(device_id)
            if row is None:
                row = len(self._row)
                if row >= self._table.shape[0]:
                    grown = np.zeros((2 * self._table.shape[0], self.dim), dtype=self.dtype)
                    grown[:row] = self._table[:row]
                    self._table = grown
                self._row[device_id] = row
            self._table[row] = value.astype(self.dtype)
        # The sum the direction was computed with, so what was used is what is kept.
        self._sum = plan.sum_after

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume: ids as lists, the used table rows and the running sum as
        arrays (the sum is kept, not recomputed, so a resumed run matches bit for bit)."""
        rows = [""] * len(self._row)
        for device_id, r in self._row.items():
            rows[r] = device_id
        return {
            "dim": self.dim,
            "init": self.init,
            "dtype": self.dtype.name,
            "device_ids": list(self._devices),
            "row_ids": rows,
            "table": self._table[: len(self._row)].copy(),
            "sum": self._sum.copy(),
            "stamps": [self._stamp.get(i, -1) for i in rows],  # -1: not known
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            dim = int(state["dim"])
            init = str(state["init"])
            dtype = np.dtype(str(state["dtype"]))
            device_ids = [str(i) for i in state["device_ids"]]
            row_ids = [str(i) for i in state["row_ids"]]
            table = np.asarray(state["table"])
            total = np.asarray(state["sum"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as err:
            raise SagaError(f"SAGA memory state is malformed: {err!r}") from None
        if dim != self.dim:
            raise SagaError(f"SAGA memory state has dim {dim}, this memory has {self.dim}")
        if init not in SAGA_INITS:
            raise SagaError(f"SAGA memory state init={init!r}; valid: {', '.join(SAGA_INITS)}")
        if table.shape != (len(row_ids), dim) or total.shape != (dim,):
            raise SagaError(
                f"SAGA memory state: table {table.shape} and sum {total.shape} do not fit "
                f"{len(row_ids)} rows of dim {dim}"
            )
        if not set(row_ids) <= set(device_ids) or len(set(row_ids)) != len(row_ids):
            raise SagaError("SAGA memory state: row ids are not distinct registered devices")
        self.init = init
        self.dtype = dtype
        self._devices = dict.fromkeys(device_ids)
        self._row = {device_id: r for r, device_id in enumerate(row_ids)}
        self._table = np.zeros((max(1, 2 * len(row_ids)), dim), dtype=dtype)
        self._table[: len(row_ids)] = table
        self._sum = total.copy()
        stamps = [int(x) for x in state.get("stamps", [-1] * len(row_ids))]
        if len(stamps) != len(row_ids):
            raise SagaError("SAGA memory state: stamps do not fit the rows")
        self._stamp = {i: st for i, st in zip(row_ids, stamps, strict=True) if st >= 0}
