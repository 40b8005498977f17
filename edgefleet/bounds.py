"""How much of what a device sends the server may keep, log or write: the caps, and the one
way a device-supplied value is described.

Anything a device sends can reach a rejection reason, a log line, a ``metrics.jsonl`` row,
``fleet.json``, the checkpoint and the device registry's kept rejections. Flower accepts
messages up to 512 MB, so none of those may quote a value as the device sent it: a
``num-examples`` that is an 8 MB list of floats once put a 5 MB reason in every round's row.
Here a value is described by its type and size, with a short preview of a string or a number
(:func:`describe`, :func:`preview`), a list of names by its first few (:func:`names`), and a
reason is cut to :data:`MAX_REASON_CHARS` on one line (:func:`bound_reason`).

The caps are declared once, here; ``docs/reference/input-bounds.md`` lists each one with
what happens to a message over it (a test checks that its table matches these values).

Standard library only, like :mod:`edgefleet.wire`: the library (:mod:`edgefleet.strategies`)
and CA-HFP's plan (:mod:`edgefleet.pruning`) import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

# -- what a message may hold (over a cap: the reply or answer is rejected) ------------------

# Metric keys in one reply's MetricRecord (train or evaluate). EdgeFleet's ClientApp sends 6,
# Flower's quickstart 2; 256 leaves room for per-class figures of a 100-class data set.
MAX_METRIC_KEYS = 256
# Characters in one metric key: keys are kept in the aggregated metrics (Flower's Result,
# the rows' federated evaluation), so a long one would be written every round.
MAX_METRIC_KEY_CHARS = 128
# Records (ArrayRecords, MetricRecords and ConfigRecords together) in one reply. EdgeFleet's
# ClientApp sends at most 4 (arrays, metrics, CA-HFP's kept, the energy mod's energy).
MAX_RECORDS = 64
# Arrays in one ArrayRecord of a reply. A model's state dict (a ResNet-152 has about 900
# tensors with its BatchNorm buffers) is far under it; the model record must match the global
# model's keys anyway, so this only stops a reply from making the server sort and list
# thousands of names.
MAX_ARRAYS = 4096
# Classes a status answer's ``labels`` may name, and one past the largest class index: the
# sessions wrapper writes the union of the present devices' labels into every row.
MAX_LABELS = 1024
# Digits of a device id (a non-negative integer): an id is written into every row that
# names the device.
MAX_DEVICE_ID_DIGITS = 18

# -- what the server writes of it (over a cap: cut, or the oldest forgotten) ----------------

# Characters of one rejection or refusal reason (rows, fleet.json, the registry, the log).
MAX_REASON_CHARS = 500
# Characters of a string value quoted in a reason or a log line (then "... (N chars)").
MAX_VALUE_CHARS = 40
# Names quoted in a reason (array, record or metric names): the first few, then a count.
MAX_NAMES_SHOWN = 5
# Characters of each such name.
MAX_NAME_CHARS = 40
# Rejection reasons a device's registry record keeps (the newest): fleet.json shows the last
# 5, the checkpoint keeps these.
REJECTIONS_KEPT = 20

_ELLIPSIS = "…"
_SAMPLE = 1000  # elements of a list looked at to name its element type


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (a newline, an escape that would
    forge a log line or move a terminal's cursor) written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def truncate(text: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` on one line and at most ``limit`` characters: a longer one is cut, and says
    how long it was. An exception by its message; any other value that is not a string by
    :func:`preview`."""
    if isinstance(text, BaseException):
        text = str(text) or type(text).__name__
    elif not isinstance(text, str):
        text = preview(text)
    head = one_line(text[:limit])
    if len(text) <= limit and len(head) <= limit:
        return head
    suffix = f"{_ELLIPSIS} ({len(text):,} chars)"
    keep = max(0, limit - len(suffix))
    return one_line(text[:keep])[:keep] + suffix


def bound_reason(reason: object) -> str:
    """A rejection reason as rows, logs and the registry keep it: one line, at most
    :data:`MAX_REASON_CHARS` characters."""
    return truncate(reason, MAX_REASON_CHARS)


def preview(value: object) -> str:
    """A scalar as a reason quotes it: a number's repr (an int of more than 64 bits by its
    size: ``str`` of one with thousands of digits raises), a string's repr cut to
    :data:`MAX_VALUE_CHARS`; anything else by :func:`describe`."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an int of {value.bit_length():,} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        # repr escapes what is not printable; a string of wide escapes is cut once more
        head = truncate(repr(value[:MAX_VALUE_CHARS]), 4 * MAX_VALUE_CHARS + 2)
        return (
            head if len(value) <= MAX_VALUE_CHARS else f"{head}{_ELLIPSIS} ({len(value):,} chars)"
        )
    return describe(value)


def describe(value: object) -> str:
    """What a device sent, by type and size, never its whole value: ``int 5``,
    ``float nan``, ``str 'abc'``, ``str 'xxxx'… (1,000,000 chars)``, ``list of 1,000,000
    floats``, ``bytes of 12 bytes``, ``ConfigRecord of 3 keys``."""
    if value is None:
        return "None"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"int of {value.bit_length():,} bits"
    if isinstance(value, bool | int | float):
        return f"{type(value).__name__} {preview(value)}"
    if isinstance(value, str):
        return f"str {preview(value)}"
    if isinstance(value, bytes | bytearray):
        return f"{type(value).__name__} of {len(value):,} bytes"
    if isinstance(value, list | tuple | set | frozenset):
        if not value:
            return f"empty {type(value).__name__}"
        kinds = {type(v).__name__ for v in itertools.islice(value, _SAMPLE)}
        what = f"{kinds.pop()}s" if len(kinds) == 1 else "values"
        return f"{type(value).__name__} of {len(value):,} {what}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value):,} keys"
    return f"a {type(value).__name__}"


def names(items: Iterable[object], shown: int = MAX_NAMES_SHOWN) -> str:
    """Names (of arrays, records, metrics) as a reason lists them: sorted, the first
    ``shown``, each cut to :data:`MAX_NAME_CHARS`, then how many more there are:
    ``['a', 'b', ... (19,998 more)]``."""
    every = sorted(str(i) for i in items)
    parts = [repr(truncate(n, MAX_NAME_CHARS)) for n in every[:shown]]
    if len(every) > shown:
        parts.append(f"... ({len(every) - shown:,} more)")
    return "[" + ", ".join(parts) + "]"
