"""What a reply must look like before any strategy sees it, and who sent it.

Flower's FedAvg family checks the replies of a round *together* and raises
``InconsistentMessageReplies`` (which ends the ServerApp) when one reply differs from the
others. A fleet holds devices on other client versions, buggy ones and hostile ones, so the
round loop screens each reply on its own first (:func:`check_train_reply`), drops a bad one
with its reason, and hands the strategy only replies it can aggregate
(:func:`common_metrics` trims the metrics to the keys all of them share).

A standard Flower reply is valid: one ArrayRecord (whatever its name) and one MetricRecord
(whatever its name) holding the inner strategy's weight key (``weighted_by_key``,
``num-examples`` by default). EdgeFleet's extra metrics (``device-id``, ``energy-spent``) and
CA-HFP's ``kept`` ArrayRecord are optional enrichments, never requirements.

Device identity (:func:`reply_device`): the reply's ``device-id`` metric when present (an
EdgeFleet ClientApp or a SuperNode started with ``--node-config device-id=N``), else
``node-<Flower node id>``, which is stable for a SuperNode's life.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import Strategy

from edgefleet.pruning.wire import KEPT  # NumPy only: CA-HFP's kept-channels record

DEVICE_ID = "device-id"
# Device ids are small integers on EdgeFleet's devices; anything longer than this is not an
# id a fleet hands out, and would bloat every row it is written to.
MAX_DEVICE_ID_DIGITS = 18


@dataclass(frozen=True)
class RecordKeys:
    """The record and metric names the aggregating strategy uses (Flower's FedAvg family:
    ``arrayrecord_key``, ``configrecord_key``, ``weighted_by_key``)."""

    arrays: str = "arrays"
    config: str = "config"
    weight: str = "num-examples"

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
    return next(iter(content.metric_records.values()))


def parse_device_id(value: object) -> str | None:
    """``value`` as a device id (the decimal digits of a non-negative integer), or None if it
    is not one (missing, NaN, fractional, negative, a list, absurdly long)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        return None
    number = int(value)
    if number < 0 or len(str(number)) > MAX_DEVICE_ID_DIGITS:
        return None
    return str(number)


def reply_device(msg: Message) -> str:
    """The device a reply speaks for (see the module docstring). A malformed ``device-id``
    falls back to the node; :func:`check_train_reply` rejects such a train reply anyway."""
    if not msg.has_error() and msg.has_content() and msg.content.metric_records:
        device = parse_device_id(reply_metrics(msg.content).get(DEVICE_ID))
        if device is not None:
            return device
    return f"node-{msg.metadata.src_node_id}"


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
    one MetricRecord."""
    model = [name for name in content.array_records if name != KEPT]
    if len(model) != 1 or len(content.metric_records) != 1:
        return (
            f"expected one ArrayRecord with the model and one MetricRecord, got "
            f"ArrayRecords {sorted(content.array_records)} and MetricRecords "
            f"{sorted(content.metric_records)}"
        )
    return None


def check_metrics(metrics: MetricRecord, keys: RecordKeys) -> str | None:
    """Why a train reply's metrics are unusable (the weight, the optional device id), or None."""
    n = metrics.get(keys.weight)
    if isinstance(n, bool) or not isinstance(n, int | float) or not n > 0 or not math.isfinite(n):
        return f"metric {keys.weight!r} must be a positive finite number, got {n!r}"
    if DEVICE_ID in metrics and parse_device_id(metrics[DEVICE_ID]) is None:
        return (
            f"metric {DEVICE_ID!r} must be a non-negative integer of at most "
            f"{MAX_DEVICE_ID_DIGITS} digits, got {metrics[DEVICE_ID]!r}"
        )
    return None


def check_arrays(
    arrays: ArrayRecord, expected: Mapping[str, tuple[tuple[int, ...], str]]
) -> str | None:
    """Why ``arrays`` do not match ``expected`` (key -> (shape, dtype)) or hold non-finite
    values, or None."""
    if set(arrays) != set(expected):
        missing, extra = set(expected) - set(arrays), set(arrays) - set(expected)
        return f"array keys differ: missing {sorted(missing)}, unexpected {sorted(extra)}"
    for key, (shape, dtype) in expected.items():
        got = arrays[key]
        if tuple(got.shape) != shape or got.dtype != dtype:
            return f"array {key!r}: got {got.dtype}{list(got.shape)}, want {dtype}{list(shape)}"
        value = got.numpy()
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"array {key!r} has non-finite values"
    return None


def _kind(value: object) -> str | None:
    """A metric value's aggregation kind: 'number', 'list:N', or None (not aggregatable)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return "number" if math.isfinite(value) else None
    if isinstance(value, list):
        ok = all(not isinstance(v, bool) and isinstance(v, int | float) for v in value)
        return f"list:{len(value)}" if ok and all(math.isfinite(v) for v in value) else None
    return None


def common_metrics(replies: Sequence[Message], keys: RecordKeys) -> list[Message]:
    """``replies`` with their metrics cut to the keys every reply holds with the same kind
    (a finite number, or a list of finite numbers of one length), so that Flower's
    consistency check and metric averaging cannot fail on them. Replies already fit are
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
    if all(set(k) <= keep for k in kinds):
        return list(replies)
    dropped = sorted(set().union(*kinds) - keep)
    log(
        INFO,
        "Metrics %s are not in every reply with one numeric kind: aggregating on the other %d",
        dropped,
        len(keep),
    )
    out = []
    for msg in replies:
        name, metrics = next(iter(msg.content.metric_records.items()))
        trimmed = MetricRecord({k: v for k, v in metrics.items() if k in keep})
        new = copy.copy(msg)  # the loop counts the original reply's bytes
        new.content = RecordDict(
            {
                **dict(msg.content.array_records),
                **dict(msg.content.config_records),
                name: trimmed,
            }
        )
        out.append(new)
    return out
