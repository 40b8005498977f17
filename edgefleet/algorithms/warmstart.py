"""Warm-start initialization when the device set changes between sessions.

From "Communication-Efficient Federated Learning under Dynamic Device Arrival and
Departure" (arXiv 2410.05662); reference code github.com/ZhanLun-Chang/2025_Neurips_blind_review,
``fast_adapt_utils.py`` (``initial_model_construction``) and ``fast_adpat_training.py``.

Training runs in sessions; a session ends when the set of present devices changes (see
:mod:`edgefleet.algorithms.tracker`). The first P sessions are *pilot* sessions: their final
models are stored and averaged into the *pilot model*. From then on, at every session start the
server runs V auxiliary rounds from the pilot model with the new session's devices; the
difference (result minus pilot model) is the session's *pseudo-gradient*, a fingerprint of the
devices' joint data. The new session starts from a weighted average of the stored final models
of earlier post-pilot sessions, weighted by a softmin over the distances between their
pseudo-gradients and the new one: a session whose devices looked alike contributes most.
Every piece here is a pure NumPy function or the on-disk :class:`SessionStore`; the Flower
wrapper strategy that runs sessions and auxiliary rounds lives elsewhere.

``warmstart.mode`` (the initial model of a new session):

- ``"pilot"``: the paper's method above. Choose it when device sets (and so data
  distributions) recur or resemble earlier ones, and V auxiliary rounds per session change are
  affordable. Until a post-pilot session has been stored there is nothing to weigh, so the
  first post-pilot session still runs its auxiliary rounds (its pseudo-gradient is stored
  with it) but starts from the previous model, as the baseline does (the reference starts
  it from the initial random model, ``fast_adpat_training.py``).
- ``"previous"``: the last session's final model. No extra
  rounds; choose it when consecutive device sets differ little (slow drift). It is the worst
  choice when the new set resembles an older session more than the last one.
- ``"average"``: the equal-weight average of the stored post-pilot final models
  (:func:`average_states`). No extra rounds; a baseline of the paper, robust when no earlier
  session is much like the new one.
- ``"fresh"``: the initial random model, as if the federation were new. For comparison only,
  or when earlier knowledge is known to hurt.
- ``"continuous"``: the paper's *Continuous* baseline (the reference's
  ``local_training_continuous``): the session starts from the last session's final model, as
  ``previous``, and every device adds lambda x KL(p_last || p_local) to its cross-entropy,
  with p_last the softmax of the last session's final model on the same mini-batch
  (temperature 1, mean over the batch; the reference's ``F.kl_div(log_softmax(local),
  softmax(last), "batchmean")``). It keeps what the last session learnt while the new one
  trains, a continual-learning baseline. It needs a ClientApp that implements the term
  (EdgeFleet's does, see :mod:`edgefleet.strategies.warmstart_initializer` for what goes on
  the wire); a ClientApp that ignores it trains as ``previous``.

Learning rates (the reference's experiments): within each session the client rate decays
polynomially, lr_t = (lr - lr_min) (1 - t/T)^0.9 + lr_min over the session's T rounds
(:func:`session_lr`), and auxiliary rounds train at a constant lr/2. Both reach the devices
as the ``lr`` entry of the train config.

Temperature: the softmin weight is w_z = exp(-R d_z) / sum_y exp(-R d_y), with R the
reference's ``--similarity_scale`` (its README example uses R = 10). Larger R concentrates the
weight on the nearest session; R -> 0 gives the plain average. Distances lie in [0, 2]
(unit-normalised tensors), so R of order 10 separates sessions whose mean per-tensor distance
differs by 0.1 by a factor e.

Memory: each stored post-pilot session holds two model-sized states (final model and
pseudo-gradient) in RAM and on disk, each pilot session one; ``max_stored`` bounds the
post-pilot ones (the reference keeps all sessions of a run, its count known in advance).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.errors import SettingError
from edgefleet.fileio import atomic_write, atomic_write_bytes


class WarmStartMode(StrEnum):
    """How a new session's model is built (``warmstart.mode``)."""

    PILOT = "pilot"
    PREVIOUS = "previous"
    AVERAGE = "average"
    FRESH = "fresh"
    CONTINUOUS = "continuous"


WARMSTART_MODES: tuple[str, ...] = tuple(m.value for m in WarmStartMode)
# The reference's decay exponent for every data set and algorithm (its README).
LR_POWER = 0.9

State = dict[str, np.ndarray]

INDEX_NAME = "index.json"
# 2: every entry carries the SHA-256 of its file (1: without; still read, unchecked).
INDEX_VERSION = 2


class WarmStartError(SettingError):
    """Bad input to the warm-start functions or a bad session store; the message says why."""


def softmin_weights(distances: Sequence[float] | np.ndarray, temperature: float) -> np.ndarray:
    """w_z = exp(-R d_z) / sum_y exp(-R d_y) with R = ``temperature`` > 0, in float64.

    The smallest distance is subtracted first, so every exponent is <= 0 and the nearest
    candidate contributes exp(0) = 1 to the sum: no overflow and no division by zero for any
    finite R and d. Equal distances give exactly equal weights. As in the reference
    (``torch.nn.Softmin`` of ``similarity * similarity_scale``).
    """
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise WarmStartError(f"distances must be a non-empty 1-D sequence, got shape {d.shape}")
    if not np.all(np.isfinite(d)):
        raise WarmStartError(f"distances must be finite, got {d.tolist()}")
    r = float(temperature)
    if not (math.isfinite(r) and r > 0):
        raise WarmStartError(f"temperature R={temperature!r} must be finite and > 0")
    e = np.exp(-r * (d - d.min()))
    return e / e.sum()


def session_lr(
    base: float, min_ratio: float, t: int, rounds: int, power: float = LR_POWER
) -> float:
    """The client learning rate of a session's training round ``t`` (0-based) of ``rounds``.

    (base - base x min_ratio) (1 - t/rounds)^power + base x min_ratio: ``base`` at t = 0,
    decaying towards base x min_ratio, as the reference's
    ``calculate_polynomial_decay_lr_schedule`` restarted at each session. ``min_ratio`` = 1
    is a constant rate. A round past ``rounds`` (a session longer than planned) keeps the
    last rate instead of going below it.
    """
    if not (math.isfinite(base) and base > 0):
        raise WarmStartError(f"base learning rate {base!r} must be finite and > 0")
    if not 0 < min_ratio <= 1:
        raise WarmStartError(f"min_ratio {min_ratio!r} must be in (0, 1]")
    if rounds < 1 or t < 0:
        raise WarmStartError(f"round {t} of {rounds}: need rounds >= 1 and t >= 0")
    low = base * min_ratio
    fraction = 1.0 - min(t, rounds - 1) / rounds
    return (base - low) * fraction**power + low


def distance_keys(state: Mapping[str, np.ndarray], param_keys: Sequence[str]) -> list[str]:
    """The keys the session distance is taken over: parameters that are not biases.

    ``param_keys`` names the trainable parameters (``model.named_parameters()``); every other
    key of ``state`` is a buffer (BatchNorm running statistics, ``num_batches_tracked``) and is
    dropped, as is every parameter whose name ends in ``"bias"``. The order is that of
    ``state``. The reference compares ``named_parameters`` whose name does not *contain*
    ``"bias"``; ending in it gives the same set for torchvision-style names without dropping a
    weight that merely has "bias" in a module name.
    """
    unknown = [k for k in param_keys if k not in state]
    if unknown:
        raise WarmStartError(f"parameter keys not in the model state: {unknown}")
    params = set(param_keys)
    return [k for k in state if k in params and not k.endswith("bias")]


def _unit(x: np.ndarray) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64).ravel()
    norm = float(np.linalg.norm(v))
    # A zero tensor (a layer nobody moved) has no direction; it stays zero, so it lies at
    # distance 1 from every non-zero direction. The reference divides by the norm and gets NaN.
    return v / norm if norm > 0 else v


def tensor_distance(
    a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], keys: Sequence[str]
) -> float:
    """Mean over ``keys`` of ||a_k/||a_k|| - b_k/||b_k|| ||_2, computed in float64.

    Each tensor is flattened and scaled to unit length first, so the distance compares
    directions layer by layer and no large layer dominates; it lies in [0, 2] per tensor.
    A zero tensor stays zero (the reference would produce NaN). This is the reference's
    ``two_norm`` similarity (``sim_fn = (a - b).norm(p=2)`` on ``x / x.norm()``, then
    ``.mean()`` over the non-bias parameters), there in float32.
    """
    if not keys:
        raise WarmStartError("no keys to take the distance over")
    total = 0.0
    for key in keys:
        if key not in a or key not in b:
            raise WarmStartError(f"key {key!r} is missing from one of the two states")
        x, y = np.asarray(a[key]), np.asarray(b[key])
        if x.shape != y.shape:
            raise WarmStartError(f"key {key!r}: shapes {x.shape} and {y.shape} differ")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise WarmStartError(f"key {key!r}: non-finite entries")
        total += float(np.linalg.norm(_unit(x) - _unit(y)))
    return total / len(keys)


def average_states(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> State:
    """sum_z w_z state_z / sum_z w_z over every key, in the key order of ``states[0]``.

    Accumulated in float64; floating-point arrays keep their dtype; integer and bool arrays
    (``num_batches_tracked``) get the weighted average rounded to the nearest integer, in their
    dtype (the reference accumulates them in float32 and ``load_state_dict`` truncates).
    States with weight zero are skipped, so a one-hot weight returns that state exactly.
    """
    if len(states) == 0:
        raise WarmStartError("no states to average")
    if len(states) != len(weights):
        raise WarmStartError(f"{len(states)} states but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise WarmStartError(f"weights must be finite and >= 0, got {w.tolist()}")
    if w.sum() <= 0:
        raise WarmStartError("weights are all zero")
    w = w / w.sum()
    first = states[0]
    for z, s in enumerate(states[1:], start=1):
        if set(s) != set(first):
            diff = sorted(set(s) ^ set(first))
            raise WarmStartError(f"state {z} has other keys than state 0: {diff}")
    out: State = {}
    for key, ref in first.items():
        ref = np.asarray(ref)
        acc = np.zeros(ref.shape, dtype=np.float64)
        for z, (s, wz) in enumerate(zip(states, w, strict=True)):
            x = np.asarray(s[key])
            if x.shape != ref.shape or x.dtype != ref.dtype:
                raise WarmStartError(
                    f"key {key!r}: state {z} has {x.dtype}{list(x.shape)}, "
                    f"state 0 has {ref.dtype}{list(ref.shape)}"
                )
            if wz > 0:
                acc += wz * x.astype(np.float64)
        if ref.dtype.kind in "iub":
            acc = np.rint(acc)
        out[key] = acc.astype(ref.dtype)
    return out


def pilot_model(states: Sequence[Mapping[str, np.ndarray]]) -> State:
    """The pilot model: the equal-weight average of the pilot sessions' final models.

    The reference averages only the floating-point tensors and leaves the integer buffers at
    the initial model's values; here they are averaged and rounded like everything else.
    """
    return average_states(states, [1.0] * len(states))


def pseudo_gradient(result: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> State:
    """``result - start`` over the floating-point keys, in ``result``'s key order and dtype.

    ``start`` is the pilot model and ``result`` the model after the V auxiliary rounds; the
    reference's ``computed_grads`` (with ``inv_lr = 1``), there over ``named_parameters``
    only. Float buffers (running statistics) are included; :func:`distance_keys` leaves them
    out of the distance. Integer buffers have no meaningful difference and are skipped.
    """
    if set(result) != set(start):
        raise WarmStartError(f"result and start differ in keys: {sorted(set(result) ^ set(start))}")
    out: State = {}
    for key, r in result.items():
        r, s = np.asarray(r), np.asarray(start[key])
        if r.dtype.kind != "f":
            continue
        if r.shape != s.shape:
            raise WarmStartError(f"key {key!r}: shapes {r.shape} and {s.shape} differ")
        out[key] = (r.astype(np.float64) - s.astype(np.float64)).astype(r.dtype)
    return out


@dataclass
class StoredSession:
    """One finished session: its final model, its pseudo-gradient and who took part.

    Pilot sessions have no pseudo-gradient (``pseudo_grad is None``): they only feed the pilot
    model. ``devices`` are the stable device ids of the session's founding set.
    """

    session: int
    final: dict[str, np.ndarray]
    pseudo_grad: dict[str, np.ndarray] | None
    devices: list[str]

    @property
    def is_pilot(self) -> bool:
        return self.pseudo_grad is None


def session_distances(
    pseudo_grad: Mapping[str, np.ndarray], stored: Sequence[StoredSession], keys: Sequence[str]
) -> np.ndarray:
    """:func:`tensor_distance` from ``pseudo_grad`` to each stored session's pseudo-gradient."""
    out = []
    for s in stored:
        if s.pseudo_grad is None:
            raise WarmStartError(f"session {s.session} is a pilot session: no pseudo-gradient")
        out.append(tensor_distance(pseudo_grad, s.pseudo_grad, keys))
    return np.asarray(out, dtype=np.float64)


def warm_start_model(
    pseudo_grad: Mapping[str, np.ndarray],
    stored: Sequence[StoredSession],
    keys: Sequence[str],
    temperature: float,
) -> tuple[State, np.ndarray]:
    """The new session's initial model and the softmin weights of the stored sessions.

    d_z = :func:`tensor_distance` (new pseudo-gradient, session z's pseudo-gradient),
    w = :func:`softmin_weights` (d, R), model = sum_z w_z final_z. As the reference's
    ``initial_model_construction`` (``two_norm`` branch). ``stored`` must be non-empty: with
    no post-pilot session yet, start from the pilot model instead.
    """
    if not stored:
        raise WarmStartError("no stored post-pilot sessions to warm-start from")
    weights = softmin_weights(session_distances(pseudo_grad, stored, keys), temperature)
    return average_states([s.final for s in stored], weights.tolist()), weights


class SessionStore:
    """Finished sessions, kept in memory and (with a directory) on disk.

    Pilot sessions (no pseudo-gradient) are kept apart from the post-pilot *candidates* and
    never evicted: the pilot model is their average. At most ``max_stored`` candidates are
    kept; adding one more evicts the oldest (lowest session number) and deletes its file.
    Adding a session number that is already stored replaces it (a resumed server may finish
    the same session again).

    On disk: one ``session-NNNNNN.npz`` per session (arrays only, read with
    ``allow_pickle=False``: loading never unpickles) and ``index.json`` (format version,
    and per session its file and the file's SHA-256) listing them; each is written to a
    temporary file and moved into place, the index last, so the index names only complete
    files. A file whose checksum differs from the index's is refused. The directory is the
    state: :meth:`load` restores the store after a restart. Arrays are copied on :meth:`add`.
    """

    def __init__(self, directory: Path | None, max_stored: int) -> None:
        if isinstance(max_stored, bool) or not isinstance(max_stored, int) or max_stored < 1:
            raise WarmStartError(f"max_stored={max_stored!r} must be an integer >= 1")
        self.directory = Path(directory) if directory is not None else None
        self.max_stored = max_stored
        self._pilots: dict[int, StoredSession] = {}
        self._candidates: dict[int, StoredSession] = {}
        self._sha256: dict[int, str] = {}  # session -> checksum of its file
        if self.directory is not None:
            if (self.directory / INDEX_NAME).exists():
                raise WarmStartError(
                    f"{self.directory / INDEX_NAME} exists: this directory already holds a "
                    "session store; open it with SessionStore.load"
                )
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- queries ----------------------------------------------------------------------------

    def candidates(self) -> list[StoredSession]:
        """Post-pilot sessions (with a pseudo-gradient), oldest first."""
        return [self._candidates[k] for k in sorted(self._candidates)]

    def pilots(self) -> list[StoredSession]:
        """Pilot sessions, oldest first."""
        return [self._pilots[k] for k in sorted(self._pilots)]

    def latest(self) -> StoredSession | None:
        """The stored session with the highest number (for ``mode="previous"``), or None."""
        everything = {**self._pilots, **self._candidates}
        return everything[max(everything)] if everything else None

    def __len__(self) -> int:
        return len(self._pilots) + len(self._candidates)

    # -- changes ----------------------------------------------------------------------------

    def add(self, stored: StoredSession) -> None:
        """Store a finished session (persisted before returning); evict beyond max_stored."""
        if isinstance(stored.session, bool) or not isinstance(stored.session, int):
            raise WarmStartError(f"session number {stored.session!r} must be an int")
        if not stored.final:
            raise WarmStartError(f"session {stored.session}: final model is empty")
        if stored.pseudo_grad is not None and not stored.pseudo_grad:
            raise WarmStartError(f"session {stored.session}: pseudo-gradient is empty")
        copy = StoredSession(
            session=stored.session,
            final={k: np.array(v, copy=True) for k, v in stored.final.items()},
            pseudo_grad=(
                None
                if stored.pseudo_grad is None
                else {k: np.array(v, copy=True) for k, v in stored.pseudo_grad.items()}
            ),
            devices=[str(d) for d in stored.devices],
        )
        if self.directory is not None:
            self._write_session(copy)
        self._pilots.pop(copy.session, None)
        self._candidates.pop(copy.session, None)
        (self._pilots if copy.is_pilot else self._candidates)[copy.session] = copy
        self._evict_and_persist()

    def _evict_and_persist(self) -> None:
        evicted = sorted(self._candidates)[: max(0, len(self._candidates) - self.max_stored)]
        for k in evicted:
            del self._candidates[k]
            self._sha256.pop(k, None)
        if self.directory is None:
            return
        self._write_index()
        # Files go after the index no longer names them: a crash in between leaves an
        # orphan file, which load ignores, never an index entry without its file.
        for k in evicted:
            (self.directory / _file_name(k)).unlink(missing_ok=True)

    # -- disk -------------------------------------------------------------------------------

    def _write_session(self, s: StoredSession) -> None:
        assert self.directory is not None
        arrays: dict[str, Any] = {
            "final_keys": np.array(list(s.final), dtype=np.str_),
        }
        for i, v in enumerate(s.final.values()):
            arrays[f"final_{i}"] = v
        if s.pseudo_grad is not None:
            arrays["grad_keys"] = np.array(list(s.pseudo_grad), dtype=np.str_)
            for i, v in enumerate(s.pseudo_grad.values()):
                arrays[f"grad_{i}"] = v
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        data = buf.getvalue()
        self._sha256[s.session] = hashlib.sha256(data).hexdigest()
        atomic_write_bytes(self.directory / _file_name(s.session), data)

    def _write_index(self) -> None:
        assert self.directory is not None
        index = {
            "version": INDEX_VERSION,
            "sessions": [
                {
                    "session": s.session,
                    "file": _file_name(s.session),
                    "pilot": s.is_pilot,
                    "devices": s.devices,
                    "sha256": self._sha256[s.session],
                }
                for s in self.pilots() + self.candidates()
            ],
        }
        text = json.dumps(index, indent=1).encode()
        atomic_write(self.directory / INDEX_NAME, lambda f: f.write(text))

    @classmethod
    def open(cls, directory: str | os.PathLike[str], max_stored: int) -> SessionStore:
        """The store in ``directory``: the one an earlier run left there (:meth:`load`), or
        a new, empty one."""
        directory = Path(directory)
        if (directory / INDEX_NAME).exists():
            return cls.load(directory, max_stored)
        return cls(directory, max_stored)

    def last_session(self) -> int:
        """The highest session number stored (0: none)."""
        return max([*self._pilots, *self._candidates], default=0)

    @classmethod
    def load(cls, directory: Path, max_stored: int) -> SessionStore:
        """Restore a store from ``directory`` (exact arrays and dtypes).

        A ``max_stored`` smaller than the number of stored candidates evicts the oldest at
        once (and rewrites the index). A missing or corrupt file raises
        :class:`WarmStartError` naming it.
        """
        if isinstance(max_stored, bool) or not isinstance(max_stored, int) or max_stored < 1:
            raise WarmStartError(f"max_stored={max_stored!r} must be an integer >= 1")
        directory = Path(directory)
        index_path = directory / INDEX_NAME
        try:
            index = json.loads(index_path.read_text())
            entries = index["sessions"]
            version = index["version"]
        except FileNotFoundError:
            raise WarmStartError(f"session store index {index_path} is missing") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise WarmStartError(f"session store index {index_path} is corrupt: {err!r}") from None
        if version not in (1, INDEX_VERSION):
            raise WarmStartError(f"{index_path}: version {version!r}, expected {INDEX_VERSION}")
        store = cls.__new__(cls)
        store.directory = directory
        store.max_stored = max_stored
        store._pilots, store._candidates, store._sha256 = {}, {}, {}
        for entry in entries:
            try:
                session = int(entry["session"])
                name = str(entry["file"])
                pilot = bool(entry["pilot"])
                devices = [str(d) for d in entry["devices"]]
                checksum = str(entry["sha256"]) if version >= 2 else None
            except (KeyError, TypeError, ValueError) as err:
                raise WarmStartError(f"{index_path}: malformed entry {entry!r}: {err!r}") from None
            if Path(name).name != name:  # the index names files in its own folder only
                raise WarmStartError(f"{index_path}: entry file {name!r} is not in the store")
            final, grad, digest = _read_session(directory / name, pilot, checksum)
            store._sha256[session] = digest
            target = store._pilots if pilot else store._candidates
            target[session] = StoredSession(session, final, grad, devices)
        if len(store._candidates) > max_stored:
            store._evict_and_persist()
        return store


def _file_name(session: int) -> str:
    return f"session-{session:06d}.npz"


def _read_session(path: Path, pilot: bool, checksum: str | None) -> tuple[State, State | None, str]:
    if not path.exists():
        raise WarmStartError(f"session store file {path} is missing (listed in the index)")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if checksum is not None and digest != checksum:
        raise WarmStartError(
            f"session store file {path} fails its checksum: it was altered or is damaged"
        )
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            final = _unpack(data, "final")
            grad = None if pilot else _unpack(data, "grad")
    except WarmStartError as err:
        raise WarmStartError(f"session store file {path}: {err}") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise WarmStartError(f"session store file {path} is corrupt: {err!r}") from None
    return final, grad, digest


def _unpack(data: Any, prefix: str) -> State:
    if f"{prefix}_keys" not in data.files:
        raise WarmStartError(f"no {prefix}_keys array")
    keys = [str(k) for k in data[f"{prefix}_keys"]]
    missing = [f"{prefix}_{i}" for i in range(len(keys)) if f"{prefix}_{i}" not in data.files]
    if missing:
        raise WarmStartError(f"arrays missing: {missing}")
    return {k: data[f"{prefix}_{i}"] for i, k in enumerate(keys)}
