"""What a reply must look like before any strategy sees it, and who sent it.

Flower's FedAvg family checks the replies of a round *together* and raises
``InconsistentMessageReplies`` (which ends the ServerApp) when one reply differs from the
others. A fleet holds devices on other client versions, buggy ones and hostile ones, so the
round loop screens each reply on its own first (:func:`check_train_reply`), drops a bad one
with its reason, and hands the strategy only replies it can aggregate
(:func:`common_metrics` trims the metrics to the keys all of them share).

A standard Flower reply is valid: one ArrayRecord (whatever its name) and one MetricRecord
(whatever its name) holding the inner strategy's weight key (``weighted_by_key``,
``num-examples`` by default). EdgeFleet's extra metrics (``device-id``, ``energy-spent``), the
energy mod's ``energy`` ConfigRecord and CA-HFP's ``kept`` ArrayRecord are optional
enrichments, never requirements.

Device identity (:func:`reply_device`): the reply's ``device-id`` metric when present (an
EdgeFleet ClientApp or a SuperNode started with ``--node-config device-id=N``), else
``node-<Flower node id>``, which is stable for a SuperNode's life. A claimed id is bound to
the node that first claims it (:class:`~edgefleet.loop.registry.DeviceRegistry`), and
inside the round loop a reply speaks for the device bound to its node.

Bounds (:class:`Screening`): a well-formed reply can still be absurd. What one device can
do to a round is bounded by what the server knows:

- ``num-examples`` (the weight) is finite, positive, integral and at most
  ``max_examples``. EdgeFleet's ServerApp sets it to ``local-steps`` x ``batch-size`` (the
  most samples a device of its ClientApp sees in a round); a foreign ClientApp's count is
  unknown to the library, so the default is no bound beyond 2**53 (set ``max_examples``
  when you know it; the update-norm bound below still caps what a heavy reply does).
- The update (reply minus the model sent to that node) is finite and its L2 norm at most
  ``norm_factor`` x the median update norm of the round's replies (:func:`norm_reference`;
  ``norm_factor = 0`` turns the bound off). The median needs at least
  ``MIN_NORM_REPLIES`` = 3 norms to stand against one outlier; a round with fewer replies
  takes the norms accepted in the last few rounds into the median, and while fewer than 3
  are known at all (the first rounds of a run with one or two replies) the bound is not
  applied. An update no larger than ``norm_floor`` x the L2 norm of the round's global
  model is never rejected by this bound: as a model converges the median update shrinks
  towards zero while a device whose data the others lack keeps moving, so a ratio to the
  median alone ends up rejecting honest devices. The floor is taken on the full global
  model, also for a CA-HFP submodel's update (its own channels): a compact update is held
  to the same absolute size as a full one.
- ``energy-spent``, when present, is a finite number in [0, ``max_energy``] (EdgeFleet's
  ServerApp: one round's cost, which is what its energy mod charges; a foreign app: any
  number >= 0). An absent metric is fine.
- Metrics other than the weight are not grounds for rejection: :func:`common_metrics`
  keeps the keys every reply holds with one numeric kind and leaves the rest out of the
  average (a device on another client version may send an extra key).

Sizes (:mod:`edgefleet.bounds`): a reply with more records, arrays in one ArrayRecord,
metric keys or longer metric keys than the caps there is rejected before anything lists
them, and every reason describes what a device sent by type and size (``got list of
1,000,000 floats``), never by its value.
"""

from __future__ import annotations

import copy
import io
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.constant import SType
from flwr.serverapp.strategy import Strategy

from edgefleet.bounds import (
    MAX_ARRAYS,
    MAX_DEVICE_ID_DIGITS,
    MAX_METRIC_KEY_CHARS,
    MAX_METRIC_KEYS,
    MAX_RECORDS,
    describe,
    names,
    preview,
    truncate,
)
from edgefleet.loop.context import round_or_none
from edgefleet.loop.registry import BindingMode
from edgefleet.pruning.wire import KEPT  # NumPy only: CA-HFP's kept-channels record
from edgefleet.settings import at_least, checked, choice, setting
from edgefleet.wire import DEVICE_ID, ENERGY_SPENT, NUM_EXAMPLES

# The largest weight without a known bound: every integer up to it is exact in a float64,
# and a sum of thousands of them cannot overflow.
MAX_WEIGHT = 2.0**53
# The update-norm bound: a reply's update may be at most this many times the round's median
# update norm. Honest devices measured up to 9.7x (benchmarks/claims/norm_ratios.py: 10 devices,
# 10 rounds, 8 configurations; 99th percentiles 1.4x to 9.2x, the largest with few-sample
# devices under Dirichlet splits and FedProx; 5 rejected 3 of 270 honest replies of a
# 30-round run). With equal weights an accepted update moves the model by at most k/N
# median steps, so k = 10 lets one hostile device of ten do no more than one honest step.
NORM_FACTOR = 10.0
# The floor under that bound, as a share of the global model's L2 norm. The median update
# shrinks as a run converges while a device holding data the others lack keeps moving: on
# PneumoniaMNIST (10 devices, Dirichlet 0.5, 300 rounds) one honest device's update was 12
# to 79 x the median from round 160 on and k = 10 dropped 35 of its replies. Late honest
# updates there and on BCCD stayed at or below 0.22 of the model's norm (one in a run's second
# round reached 0.82, above both bounds); a reply that zeroes the model or replaces it with
# noise is 1.0 and more. A floored update moves the model by at most norm_floor/N of its
# norm with N equal weights, less than k x median allowed in those runs' first rounds (0.9
# to 1.9 of the norm). The price: late in a run, when honest steps
# are small, one hostile device of ten may move the model by up to 5 % of its norm a round,
# where the ratio alone held it to about one honest step; a device's honest data is worth
# more to a non-IID fleet than that margin (set norm_floor = 0 to choose the other way).
NORM_FLOOR = 0.5
MIN_NORM_REPLIES = 3  # a median of fewer norms is not robust to one outlier
NORM_HISTORY_ROUNDS = 5  # rounds of accepted norms a round with few replies may draw on
BINDINGS: tuple[str, ...] = tuple(m.value for m in BindingMode)  # declared by the registry


def _norm_factor(v: float) -> str | None:
    return None if v == 0 or v >= 1 else "must be 0 (off) or >= 1"


@dataclass(frozen=True)
class ScreeningConfig:
    """``screening.*``: what one device's reply may do (README "Hostile devices")."""

    max_examples: int = setting(
        "screening.max-examples",
        0,
        at_least(0),
        "the most `num-examples` a reply may claim (0 = `local-steps` x `batch-size`, the "
        "most a device of EdgeFleet's ClientApp sees in a round)",
    )
    norm_factor: float = setting(
        "screening.norm-factor",
        NORM_FACTOR,
        _norm_factor,
        "reject an update whose norm is above this many times the round's median (0 = off)",
    )
    norm_floor: float = setting(
        "screening.norm-floor",
        NORM_FLOOR,
        at_least(0),
        "an update at most this share of the global model's norm is never rejected by "
        "`norm-factor` (0 = no floor)",
    )
    device_binding: str = setting(
        "screening.device-binding",
        "reconnect",
        choice(BINDINGS),
        "`reconnect` (a device id moves to a new node once its node is offline) or `strict` "
        "(never; with SuperNode authentication)",
    )


# Device ids are small integers on EdgeFleet's devices; one longer than MAX_DEVICE_ID_DIGITS
# (edgefleet.bounds) is not an id a fleet hands out, and would bloat every row it is in.


@dataclass(frozen=True)
class RecordKeys:
    """The record and metric names the aggregating strategy uses (Flower's FedAvg family:
    ``arrayrecord_key``, ``configrecord_key``, ``weighted_by_key``)."""

    arrays: str = "arrays"
    config: str = "config"
    weight: str = NUM_EXAMPLES

    @classmethod
    def of(cls, strategy: Strategy) -> RecordKeys:
        """The keys of the innermost strategy under EdgeFleet's wrappers (Flower's defaults
        for a strategy that does not name them)."""
        while hasattr(strategy, "inner"):
            strategy = strategy.inner
        return cls(
            arrays=str(getattr(strategy, "arrayrecord_key", cls.arrays)),
            config=str(getattr(strategy, "configrecord_key", cls.config)),
            weight=str(getattr(strategy, "weighted_by_key", cls.weight)),
        )


def reply_arrays(content: RecordDict) -> ArrayRecord:
    """The model arrays of a screened reply: its one ArrayRecord other than ``kept``."""
    return next(rec for name, rec in content.array_records.items() if name != KEPT)


def reply_metrics(content: RecordDict) -> MetricRecord:
    """The one MetricRecord of a screened reply."""
    # Not content.metric_records: Flower builds a new typed view of the records on every
    # call, and a round asks each reply for its metrics several times.
    return next(rec for rec in content.values() if isinstance(rec, MetricRecord))


def first_metrics(msg: Message) -> MetricRecord | None:
    """A reply's first MetricRecord; None for an error reply or one without any."""
    if msg.has_error() or not msg.has_content():
        return None
    return next((rec for rec in msg.content.values() if isinstance(rec, MetricRecord)), None)


def parse_device_id(value: object) -> str | None:
    """``value`` as a device id (the decimal digits of a non-negative integer), or None if it
    is not one (missing, NaN, fractional, negative, a list, absurdly long)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        return None
    number = int(value)
    # compared, not len(str(...)): str() of an int of thousands of digits raises
    if number < 0 or number >= 10**MAX_DEVICE_ID_DIGITS:
        return None
    return str(number)


def claimed_device(msg: Message) -> str | None:
    """The device id a reply claims (its well-formed ``device-id`` metric), or None."""
    metrics = first_metrics(msg)
    return None if metrics is None else parse_device_id(metrics.get(DEVICE_ID))


def reply_device(msg: Message) -> str:
    """The device a reply speaks for (see the module docstring). Inside EdgeFleet's round
    loop, the registry's name for its node: the device bound to it (from a status answer or
    an earlier reply), which a reply without a ``device-id`` metric (a Flower user's train
    handler beside EdgeFleet's status query) still speaks for; so FedSAG's memory, the
    robust rules' rows and the loop's own rows name one device one way. A malformed
    ``device-id`` falls back to the node; :func:`check_train_reply` rejects such a train
    reply anyway."""
    claimed = claimed_device(msg)
    ctx = round_or_none()
    if ctx is not None:
        return ctx.registry.name(msg.metadata.src_node_id, claimed)
    return claimed if claimed is not None else f"node-{msg.metadata.src_node_id}"


def check_train_reply(msg: Message, reference: ArrayRecord, keys: RecordKeys) -> str | None:
    """Why a (non-error) train reply with full-size arrays cannot be aggregated, or None.

    The checks are those Flower's strategies would otherwise fail on mid-aggregation, plus
    the ones that would silently poison the model (shape, dtype, non-finite values).
    """
    content = msg.content
    if KEPT in content.array_records:
        # Flower's aggregation would average the channel indices into the model.
        return f"a pruned submodel (ArrayRecord {KEPT!r}) needs SubmodelReconstruction"
    reason = check_records(content)
    if reason:
        return reason
    return check_metrics(reply_metrics(content), keys) or check_arrays(
        reply_arrays(content),
        {key: (tuple(ref.shape), ref.dtype) for key, ref in reference.items()},
    )


def check_records(content: RecordDict) -> str | None:
    """Why ``content`` does not hold one model ArrayRecord (besides CA-HFP's ``kept``) and
    one MetricRecord, or holds more records, or an ArrayRecord more arrays, than the caps
    allow (:mod:`edgefleet.bounds`)."""
    if len(content) > MAX_RECORDS:
        return f"the reply holds {len(content):,} records (at most {MAX_RECORDS})"
    arrays = content.array_records
    for name, record in arrays.items():
        if len(record) > MAX_ARRAYS:
            return (
                f"ArrayRecord {truncate(name)!r} holds {len(record):,} arrays "
                f"(at most {MAX_ARRAYS})"
            )
    model = [name for name in arrays if name != KEPT]
    metrics = content.metric_records
    if len(model) != 1 or len(metrics) != 1:
        return (
            f"expected one ArrayRecord with the model and one MetricRecord, got "
            f"ArrayRecords {names(arrays)} and MetricRecords {names(metrics)}"
        )
    return None


def check_metric_sizes(metrics: MetricRecord) -> str | None:
    """Why a reply's metrics hold more keys, or longer keys, than the caps allow, or None.
    Checked before any key is listed or aggregated: what passes is kept in the aggregated
    metrics (Flower's Result, a row's federated evaluation)."""
    if len(metrics) > MAX_METRIC_KEYS:
        return f"the reply holds {len(metrics):,} metric keys (at most {MAX_METRIC_KEYS})"
    long = next((k for k in metrics if len(k) > MAX_METRIC_KEY_CHARS), None)
    if long is not None:
        return (
            f"metric key {truncate(long)!r} has {len(long):,} characters "
            f"(at most {MAX_METRIC_KEY_CHARS})"
        )
    return None


def check_metrics(metrics: MetricRecord, keys: RecordKeys) -> str | None:
    """Why a train reply's metrics are unusable (the weight, the optional device id), or None.

    The weight must be a positive finite number up to 2**53; ``num-examples`` (a count)
    must also be a whole number. A custom weight key may be fractional. The metrics' sizes
    first (:func:`check_metric_sizes`)."""
    reason = check_metric_sizes(metrics)
    if reason:
        return reason
    n = metrics.get(keys.weight)
    if isinstance(n, bool) or not isinstance(n, int | float) or not _finite(n) or not n > 0:
        return f"metric {keys.weight!r} must be a positive finite number, got {describe(n)}"
    if n > MAX_WEIGHT:
        return f"metric {keys.weight!r} = {preview(n)} is above {MAX_WEIGHT:.0f}"
    if keys.weight == NUM_EXAMPLES and not float(n).is_integer():
        return f"metric {keys.weight!r} must be a whole number, got {preview(n)}"
    if DEVICE_ID in metrics and parse_device_id(metrics[DEVICE_ID]) is None:
        return (
            f"metric {DEVICE_ID!r} must be a non-negative integer of at most "
            f"{MAX_DEVICE_ID_DIGITS} digits, got {describe(metrics[DEVICE_ID])}"
        )
    return None


def check_arrays(
    arrays: ArrayRecord, expected: Mapping[str, tuple[tuple[int, ...], str]]
) -> str | None:
    """Why ``arrays`` do not match ``expected`` (key -> (shape, dtype)) or hold non-finite
    values, or None."""
    if len(arrays) > MAX_ARRAYS:  # before a set of their names is made
        return f"the ArrayRecord holds {len(arrays):,} arrays (at most {MAX_ARRAYS})"
    if set(arrays) != set(expected):
        missing, extra = set(expected) - set(arrays), set(arrays) - set(expected)
        return f"array keys differ: missing {names(missing)}, unexpected {names(extra)}"
    for key, (shape, dtype) in expected.items():
        got = arrays[key]
        if tuple(got.shape) != shape or got.dtype != dtype:
            return f"array {key!r}: got {got.dtype}{list(got.shape)}, want {dtype}{list(shape)}"
        value = array_values(got)
        # An Array's dtype and shape are declared apart from its bytes: a reply may declare
        # float32[3, 2] and carry float64[2], which would broadcast silently in a sum.
        if value.shape != shape or value.dtype != np.dtype(dtype):
            return (
                f"array {key!r}: declared {dtype}{list(shape)}, its data is "
                f"{value.dtype}{list(value.shape)}"
            )
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"array {key!r} has non-finite values"
    return None


def _finite(value: int | float) -> bool:
    """Whether a number is finite and fits a float (a huge Python int does not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and _finite(value)


def _kind(value: object) -> str | None:
    """A metric value's aggregation kind: 'number', 'list:N', or None (not aggregatable)."""
    if _number(value):
        return "number"
    if isinstance(value, list):
        return f"list:{len(value)}" if all(_number(v) for v in value) else None
    return None


# -- bounds ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Screening:
    """What the round loop lets one reply do (see the module docstring).

    ``max_examples``: the most the weight (``num-examples``) may be; None = no bound beyond
    2**53. ``max_energy``: the most ``energy-spent`` may be; None = any number >= 0.
    ``norm_factor``: k of the update-norm bound (k x the round's median); 0 = off.
    ``norm_floor``: an update at most this share of the global model's L2 norm passes the
    update-norm bound whatever the median; 0 = no floor (the ratio to the median alone).
    ``device_binding``: ``"reconnect"`` (default) moves a device id to a new node once the
    node it was bound to is no longer online (a device that reconnected without SuperNode
    authentication gets a new node id); ``"strict"`` never moves it (with SuperNode
    authentication a node keeps its id across reconnects, so nothing needs to move).
    """

    max_examples: float | None = None
    max_energy: float | None = None
    norm_factor: float = NORM_FACTOR
    norm_floor: float = NORM_FLOOR
    device_binding: str = "reconnect"

    @classmethod
    def from_config(
        cls, cfg: ScreeningConfig, default_max_examples: float, max_energy: float | None = None
    ) -> Screening:
        """The bounds ``screening.*`` sets; ``default_max_examples`` where
        ``screening.max-examples`` is 0 (the most a device of the app sees in a round)."""
        checked(cfg)
        return cls(
            max_examples=float(cfg.max_examples or default_max_examples),
            max_energy=max_energy,
            norm_factor=cfg.norm_factor,
            norm_floor=cfg.norm_floor,
            device_binding=cfg.device_binding,
        )

    def __post_init__(self) -> None:
        for name in ("max_examples", "max_energy"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value >= 0):
                raise ValueError(f"Screening.{name}={value!r}: must be a number >= 0 or None")
        if not (_number(self.norm_factor) and (self.norm_factor == 0 or self.norm_factor >= 1)):
            raise ValueError(f"Screening.norm_factor={self.norm_factor!r}: must be 0 (off) or >= 1")
        if not (_number(self.norm_floor) and self.norm_floor >= 0):
            raise ValueError(f"Screening.norm_floor={self.norm_floor!r}: must be a number >= 0")
        if self.device_binding not in BINDINGS:
            raise ValueError(
                f"Screening.device_binding={self.device_binding!r}: must be one of "
                f"{', '.join(BINDINGS)}"
            )


def check_bounds(metrics: MetricRecord, keys: RecordKeys, screening: Screening) -> str | None:
    """Why a (structurally valid) reply's metrics break the server's bounds, or None."""
    n = metrics.get(keys.weight)
    limit = screening.max_examples
    if limit is not None and isinstance(n, int | float) and n > limit:
        return f"metric {keys.weight!r} = {preview(n)} is above the round's bound {limit:g}"
    if ENERGY_SPENT in metrics:
        energy = metrics[ENERGY_SPENT]
        top = screening.max_energy
        if not _number(energy) or energy < 0 or (top is not None and energy > top):  # type: ignore[operator]
            span = f"[0, {top:g}]" if top is not None else ">= 0"
            return f"metric {ENERGY_SPENT!r} must be a finite number {span}, got {describe(energy)}"
    return None


# The .npy magic, and the header fields' sizes by format version (numpy.lib.format).
_NPY_MAGIC = b"\x93NUMPY"
_NPY_LENGTH_BYTES = {1: 2, 2: 4}
# Parsed .npy headers by their bytes: a fleet sends the same few (one per array of the
# model), and parsing one with numpy's parser (ast.literal_eval) costs more than the data.
_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}
_HEADERS_KEPT = 4096  # a fleet that sends more distinct headers gets them parsed each time


def array_values(arr: Array) -> np.ndarray:
    """``arr``'s values as ``arr.numpy()`` gives them, but read-only and without a copy.

    Flower's ``Array.numpy()`` runs ``np.load`` on the bytes every call: it parses the
    header and copies the data in chunks, about a millisecond for a small CNN, and screening
    reads each reply two or three times and the round's global model once per reply. Here
    the data is a view of the bytes, and the header (checked by numpy's own parser the first
    time it is seen) comes from a table. Anything else than a plain .npy of format 1 or 2
    whose data is all there (an object dtype, a short buffer, another serialization) goes to
    ``arr.numpy()``, so what cannot be read fails with Flower's and numpy's own errors."""
    data = arr.data
    if arr.stype == SType.NUMPY and isinstance(data, bytes) and data[:6] == _NPY_MAGIC:
        size = _NPY_LENGTH_BYTES.get(data[6]) if len(data) > 7 and data[7] == 0 else None
        if size is not None and len(data) >= 8 + size:
            offset = 8 + size + int.from_bytes(data[8 : 8 + size], "little")
            head = data[:offset]
            parsed = _HEADERS.get(head)
            if parsed is None:
                parsed = _parse_header(head)
            if parsed is not None:
                shape, fortran, dtype = parsed
                count = math.prod(shape)
                if count and dtype.itemsize and len(data) - offset >= count * dtype.itemsize:
                    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
                    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return arr.numpy()


def _parse_header(head: bytes) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """A .npy header's (shape, fortran order, dtype) by numpy's parser, kept in the table;
    None when numpy refuses it or the dtype holds objects (``np.load`` says why)."""
    fp = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            parsed = np.lib.format.read_array_header_1_0(fp)
        else:
            parsed = np.lib.format.read_array_header_2_0(fp)
    except Exception:  # noqa: BLE001 - np.load, called next, raises with the reason
        return None
    if parsed[2].hasobject or fp.tell() != len(head):
        return None
    if len(_HEADERS) < _HEADERS_KEPT:
        _HEADERS[head] = parsed
    return parsed


def update_norm(reply: ArrayRecord, base: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``reply - base`` over the floating-point arrays, in float64."""
    total = 0.0
    for key, arr in reply.items():
        value = array_values(arr)
        if value.dtype.kind != "f":
            continue
        total += sum_squares(np.subtract(value, base[key], dtype=np.float64).ravel())
    return math.sqrt(total)


def model_norm(arrays: ArrayRecord) -> float:
    """L2 norm of a model's floating-point arrays, in float64."""
    total = 0.0
    for arr in arrays.values():
        value = array_values(arr)
        if value.dtype.kind == "f":
            total += sum_squares(value.astype(np.float64).ravel())
    return math.sqrt(total)


def sum_squares(flat: np.ndarray) -> float:
    """The sum of squares of a 1-D float64 array, in this thread.

    Not ``np.dot``: OpenBLAS splits a long dot over its threads, and on a server whose cores
    the training processes keep busy (the Simulation Engine's Ray actors) each call waited
    for those threads to be scheduled, milliseconds a call; with 20 replies of 8 arrays a
    round, screening cost more than all of Flower's own server work. einsum's loop runs in
    the calling thread, and its sum does not depend on the BLAS's thread count."""
    return float(np.einsum("i,i->", flat, flat))


def sent_base(
    reply: ArrayRecord, sent: RecordDict | None, reference: ArrayRecord
) -> dict[str, np.ndarray]:
    """The model a reply's update is taken against: the arrays the node was sent when they
    have the reply's keys and shapes, else the round's global model."""
    if sent is not None:
        for name, record in sent.array_records.items():
            if name == KEPT:
                continue
            if set(record) == set(reply) and all(
                tuple(record[k].shape) == tuple(reply[k].shape) for k in reply
            ):
                return {k: array_values(record[k]) for k in reply}
    return {k: array_values(reference[k]) for k in reply}


def norm_reference(norms: Sequence[float], history: Iterable[float] = ()) -> float | None:
    """The update norm a round's replies are measured against: the median of ``norms`` when
    there are at least :data:`MIN_NORM_REPLIES`, else the median of ``norms`` together with
    ``history`` (norms accepted in recent rounds) when that makes enough; None when fewer
    are known (the bound is then not applied), or when the median is 0 (nobody moved: no
    scale to measure against)."""
    pool = list(norms)
    if len(pool) < MIN_NORM_REPLIES:
        pool += list(history)
    if len(pool) < MIN_NORM_REPLIES:
        return None
    median = float(statistics.median(pool))
    return median if median > 0 else None


def _record_names(msg: Message) -> tuple[tuple[str, ...], tuple[str, ...]]:
    content = msg.content
    return (
        tuple(n for n in content.array_records if n != KEPT),
        tuple(content.metric_records),
    )


def common_metrics(replies: Sequence[Message], keys: RecordKeys) -> list[Message]:
    """``replies`` made consistent for Flower's aggregation: their metrics cut to the keys
    every reply holds with the same kind (a finite number, or a list of finite numbers of
    one length), and, when the replies name their records differently, the model record
    renamed to the strategy's ``arrayrecord_key`` and the metrics to ``metrics`` (Flower's
    consistency check requires the same names in every reply). Replies that already fit are
    returned unchanged; a key dropped is logged once per round, with the reason."""
    if len(replies) < 1:
        return list(replies)
    kinds = [{k: _kind(v) for k, v in reply_metrics(m.content).items()} for m in replies]
    shared = set(kinds[0])
    for k in kinds[1:]:
        shared &= set(k)
    keep = {
        key
        for key in shared
        if kinds[0][key] is not None and all(k[key] == kinds[0][key] for k in kinds)
    }
    keep.add(keys.weight)  # checked on every reply already
    same_names = len({_record_names(m) for m in replies}) == 1
    if same_names and all(set(k) <= keep for k in kinds):
        return list(replies)
    dropped = set().union(*kinds) - keep
    if dropped:
        log(
            INFO,
            "Metrics %s are not in every reply with one numeric kind: aggregating on the other %d",
            names(dropped),
            len(keep),
        )
    if not same_names:
        log(INFO, "Replies name their records differently: renamed for aggregation")
    out = []
    for msg in replies:
        content = msg.content
        name, metrics = next(iter(content.metric_records.items()))
        trimmed = MetricRecord({k: v for k, v in metrics.items() if k in keep})
        records: dict[str, Any] = {}
        for arr_name, rec in content.array_records.items():
            records[arr_name if same_names or arr_name == KEPT else keys.arrays] = rec
        records.update(dict(content.config_records))
        records[name if same_names else "metrics"] = trimmed
        new = copy.copy(msg)  # the loop counts the original reply's bytes
        new.content = RecordDict(records)
        out.append(new)
    return out
