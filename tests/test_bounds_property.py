"""Property tests: whatever a device sends, the server keeps, logs and writes bounded bytes.

Hypothesis builds hostile train replies (arbitrary metrics, records, arrays and names, huge
strings and lists, NaN and infinities, wrong types, thousands of keys, declines with long
reasons) and hostile status answers (every status field and the telemetry record), and
runs each through the real round loop with the ServerApp's own writers of ``metrics.jsonl``
and ``fleet.json``. Nothing may raise out of the loop, and every row, the log, ``fleet.json``
and the loop's checkpoint state must stay under small absolute bounds. Derandomized (one
fixed sequence of examples: the same in CI as here), with few examples: each runs two rounds.

Also here: the helpers of :mod:`edgefleet.bounds` on arbitrary values, and the check that
``docs/reference/input-bounds.md`` states the caps' real values.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgefleet import bounds
from edgefleet.config import parse_run_config
from edgefleet.loop.context import ScreeningRow
from edgefleet.loop.registry import TELEMETRY_FIELDS
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.loop.screening import Screening, parse_device_id
from edgefleet.server.app import build_strategy
from edgefleet.server.fleet import FILENAME, FleetWriter
from edgefleet.server.results import MetricsWriter
from tests.fakes import FakeGrid, Rows, no_eval, rec

ROOT = Path(__file__).resolve().parents[1]
# derandomize: one fixed sequence of examples, the same on every machine; database=None: no
# example database to write into the checkout
PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

W0 = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)}
HONEST = 3  # devices 0..2 on nodes 1..3; the hostile device is 3 on node 4
HOSTILE_NODE = HONEST + 1
KW = {"fraction_evaluate": 0.0, "min_available_nodes": 1, "min_train_nodes": 1}

# Bounds on what two rounds of this fleet may cost, whatever the hostile device sends: a few
# times an honest run's (rows ~0.5 KB, fleet.json ~2 KB, log ~0.5 KB, state ~2 KB).
ROW_BYTES = 6_000
FLEET_BYTES = 12_000
LOG_BYTES = 16_000
STATE_BYTES = 8_000


# -- what a hostile device may send ------------------------------------------------------------

LENGTHS = st.sampled_from([1, 2, 129, 5_000, 200_000])
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
NAMES = st.one_of(
    st.sampled_from(["num-examples", "device-id", "energy-spent", "train-loss", "train-time-s",
                     "arrays", "metrics", "kept", "energy", "w", "labels"]),
    st.text(max_size=12),
    st.builds(lambda c, n: c * n, st.characters(), LENGTHS),
)  # fmt: skip


def _repeat(element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A list of one element many times: long lists without generating each element."""
    return st.builds(lambda x, n: [x] * n, element, LENGTHS)


# What a MetricRecord holds: ints, floats, and lists of one of them (Python ints of any size
# pass Flower's in-process check: 10**400 does not fit a float; one whose str() raises is
# left to test_the_descriptions_say_type_and_size, as Hypothesis could not print it).
HUGE_INT = st.just(10**400)
METRIC_VALUES = st.one_of(
    INT64, FLOATS, HUGE_INT, _repeat(INT64), _repeat(FLOATS), st.lists(FLOATS, max_size=4)
)
# What a ConfigRecord holds besides: strings, bytes, bools and lists of them.
HUGE_TEXT = st.builds(lambda c, n: c * n, st.characters(), LENGTHS)
CONFIG_VALUES = st.one_of(
    METRIC_VALUES, st.text(max_size=8), HUGE_TEXT, st.binary(max_size=8), st.booleans(),
    _repeat(st.text(max_size=3)), st.builds(lambda n: b"\0" * n, LENGTHS),
)  # fmt: skip


def _metric_record(values: dict[str, Any]) -> MetricRecord:
    return MetricRecord(values)


@st.composite
def hostile_replies(draw: st.DrawFn) -> Callable[[Message, Message], Message]:
    """How the hostile device answers a train message: (message, honest reply) -> reply."""
    kind = draw(st.sampled_from(["reply", "reply", "reply", "decline", "empty"]))
    if kind == "decline":
        reason = draw(st.one_of(st.text(max_size=20), HUGE_TEXT))
        code = draw(st.integers(min_value=0, max_value=10**6))
        return lambda msg, _: Message(Error(code=code, reason=reason), reply_to=msg)
    if kind == "empty":
        return lambda msg, _: Message(RecordDict(), reply_to=msg)

    changes = draw(st.dictionaries(NAMES, METRIC_VALUES, max_size=5))
    drop = draw(st.sets(st.sampled_from(["num-examples", "device-id", "train-loss"])))
    filler = draw(st.sampled_from([0, 3, 300, 20_000]))
    arrays_plan = draw(st.sampled_from(["same", "drop", "extra", "dtype", "nan", "shape", "big"]))
    extra_arrays = draw(st.sampled_from([1, 5_000]))
    extra_records = draw(
        st.lists(st.tuples(st.sampled_from(["metric", "config", "array"]), NAMES), max_size=3)
    )
    many_records = draw(st.sampled_from([0, 0, 70, 20_000]))
    config = draw(st.dictionaries(NAMES, CONFIG_VALUES, max_size=4))
    kept = draw(st.one_of(st.none(), st.lists(NAMES, max_size=3)))
    model_name = draw(st.one_of(st.just("arrays"), NAMES))

    def reply(msg: Message, honest: Message) -> Message:
        metrics = {k: v for k, v in honest.content["metrics"].items() if k not in drop}
        metrics.update(changes)
        metrics.update({f"filler-{i}": 1.0 for i in range(filler)})
        w = honest.content["arrays"]["w"].numpy()
        arrays = {"w": w}
        if arrays_plan == "drop":
            arrays = {}
        elif arrays_plan == "extra":
            arrays.update({f"extra-{i}": np.zeros(1, np.float32) for i in range(extra_arrays)})
        elif arrays_plan == "dtype":
            arrays = {"w": w.astype(np.float64)}
        elif arrays_plan == "nan":
            arrays = {"w": np.full_like(w, np.nan)}
        elif arrays_plan == "shape":
            arrays = {"w": np.zeros(extra_arrays, np.float32)}
        elif arrays_plan == "big":
            arrays = {"w": w * np.float32(1e30)}
        records: dict[str, Any] = {
            model_name: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": _metric_record(metrics),
        }
        for what, name in extra_records:
            records[name] = {
                "metric": lambda: MetricRecord({"x": 1.0}),
                "config": lambda: ConfigRecord(config),
                "array": lambda: ArrayRecord({"a": Array(np.zeros(1, np.float32))}),
            }[what]()
        records.update({f"record-{i}": ConfigRecord({"x": 1}) for i in range(many_records)})
        if kept is not None:
            records["kept"] = ArrayRecord({g: Array(np.arange(2, dtype=np.int64)) for g in kept})
        return Message(RecordDict(records), reply_to=msg)

    return reply


def honest_reply(msg: Message, device: int) -> Message:
    got = msg.content["arrays"]["w"].numpy()
    new = got + 0.01 * (device + 1)
    metrics = MetricRecord(
        {"num-examples": 10 * (device + 1), "train-loss": 1.0, "device-id": device,
         "energy-spent": 1.0}
    )  # fmt: skip
    return Message(RecordDict({"arrays": rec(w=new), "metrics": metrics}), reply_to=msg)


# -- running them ------------------------------------------------------------------------------


@contextmanager
def logged() -> Iterator[list[str]]:
    """Every message Flower's logger emits meanwhile (no pytest fixture: Hypothesis runs many
    examples in one test function)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("flwr")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_fleet(
    handlers: dict[int, Callable[[Message], Message]], strategy: Any, run_dir: Path
) -> Rows:
    """Two rounds of the real loop with the ServerApp's writers; asserts what they cost."""
    keep = Rows()
    callbacks = [*getattr(strategy, "round_callbacks", list)(), MetricsWriter(run_dir),
                 FleetWriter(run_dir), keep]  # fmt: skip
    # node_wait_timeout: a strategy that waits for nodes nobody selected gives up at once
    loop = RoundLoop(strategy, FakeGrid(handlers), evaluate_fn=no_eval, callbacks=callbacks,  # type: ignore[arg-type]
                     screening=Screening(max_examples=100.0), node_wait_timeout=0.5)  # fmt: skip
    with logged() as lines:
        loop.run(rec(W0), 2)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2
    assert max(len(r) for r in rows) < ROW_BYTES, [len(r) for r in rows]
    assert len((run_dir / FILENAME).read_text()) < FLEET_BYTES
    assert sum(len(line) for line in lines) < LOG_BYTES, sorted(map(len, lines))[-3:]
    assert len(json.dumps(loop.state_dict())) < STATE_BYTES
    for res in keep.results:
        assert res.context.section(ScreeningRow).round_dropped is None
        assert all(np.isfinite(a.numpy()).all() for a in res.arrays.values())
    return keep


STACKS: dict[str, Callable[[], Any]] = {
    "fedavg": lambda: FedAvg(**KW),  # type: ignore[arg-type]
    # EdgeFleet's own server stack from the run config: CA-HFP's reconstruction (which takes
    # compact replies with a `kept` record) around FedSAG
    "edgefleet": lambda: build_strategy(parse_run_config({"strategy": "fedsag"})),
}


@PROPERTY
@given(
    reply=hostile_replies(),
    from_round=st.sampled_from([1, 2]),
    stack=st.sampled_from(sorted(STACKS)),
)
def test_a_hostile_train_reply_costs_bounded_bytes(
    reply: Callable[[Message, Message], Message], from_round: int, stack: str
) -> None:
    rounds = iter(range(1, 10))
    sent: list[Message] = []

    def hostile(msg: Message) -> Message:
        honest = honest_reply(msg, HONEST)
        sent.append(reply(msg, honest) if next(rounds) >= from_round else honest)
        return sent[-1]

    handlers = {d + 1: (lambda m, d=d: honest_reply(m, d)) for d in range(HONEST)}
    handlers[HOSTILE_NODE] = hostile
    with tempfile.TemporaryDirectory() as tmp:
        keep = run_fleet(handlers, STACKS[stack](), Path(tmp))
    claims = [m.content if m.has_content() else None for m in sent]
    for res, content in zip(keep.results, claims, strict=True):  # no honest device loses
        assert _honest(content) <= set(res.participants), res.rejected


def _honest(content: RecordDict | None) -> set[str]:
    """The honest devices, less one whose id the hostile device claims: a claim of an
    honest device's id refuses both claimants (the server cannot tell which is the device)."""
    claimed = None
    for record in (content or RecordDict()).values():
        if isinstance(record, MetricRecord | ConfigRecord) and "device-id" in record:
            claimed = parse_device_id(record["device-id"])
    return {str(d) for d in range(HONEST)} - {claimed}


STATUS_KEYS = st.sampled_from(
    ["device-id", "feasible", "present", "labels", "battery-level", "num-partitions"]
)


@st.composite
def hostile_status(draw: st.DrawFn) -> tuple[RecordDict, str]:
    """A status answer (the records of its content) and the wrapper that asks for it."""
    status = draw(st.dictionaries(st.one_of(STATUS_KEYS, NAMES), METRIC_VALUES, max_size=6))
    if draw(st.booleans()):  # a well-formed id, so that the rest of the answer is looked at
        status["device-id"] = HONEST
    telemetry = draw(
        st.dictionaries(st.one_of(st.sampled_from(sorted(TELEMETRY_FIELDS)), NAMES),
                        CONFIG_VALUES, max_size=8)
    )  # fmt: skip
    filler = draw(st.sampled_from([0, 20_000]))
    telemetry.update({f"t-{i}": 1.0 for i in range(filler)})
    as_kind = draw(st.sampled_from(["metric", "metric", "config"]))
    records: dict[str, Any] = {
        "status": MetricRecord(status) if as_kind == "metric" else ConfigRecord(status),
        "telemetry": ConfigRecord(telemetry),
    }
    return RecordDict(records), draw(st.sampled_from(["energy", "sessions"]))


@PROPERTY
@given(answer=hostile_status())
def test_a_hostile_status_answer_costs_bounded_bytes(answer: tuple[RecordDict, str]) -> None:
    from edgefleet.strategies.energy_selection import EnergyAgeSelection
    from edgefleet.strategies.warmstart_initializer import WarmStartInitializer

    content, wrapper = answer

    def node(device: int, status: RecordDict | None) -> Callable[[Message], Message]:
        def handle(msg: Message) -> Message:
            if msg.metadata.message_type != MessageType.QUERY:
                return honest_reply(msg, device)
            if status is not None:
                return Message(status, reply_to=msg)
            good = {"device-id": device, "feasible": 1, "labels": [device]}
            return Message(RecordDict({"status": MetricRecord(good)}), reply_to=msg)  # type: ignore[arg-type]

        return handle

    handlers = {d + 1: node(d, None) for d in range(HONEST)}
    handlers[HOSTILE_NODE] = node(HONEST, content)
    with tempfile.TemporaryDirectory() as tmp:
        if wrapper == "energy":
            strategy: Any = EnergyAgeSelection(FedAvg(**KW), max_devices=4, slots_per_round=1)  # type: ignore[arg-type]
        else:
            strategy = WarmStartInitializer(FedAvg(**KW), store=Path(tmp) / "s", initial=rec(W0))  # type: ignore[arg-type]
        keep = run_fleet(handlers, strategy, Path(tmp))
    for res in keep.results:
        assert _honest(content) <= set(res.participants)


# -- the helpers on anything -------------------------------------------------------------------

ANYTHING = st.recursive(
    st.one_of(st.none(), st.booleans(), INT64, HUGE_INT, FLOATS, st.text(),
              HUGE_TEXT, st.binary(), _repeat(FLOATS)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(), inner,
                                                                        max_size=4)),
    max_leaves=10,
)  # fmt: skip


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(value=ANYTHING, limit=st.integers(min_value=0, max_value=600))
def test_a_value_is_described_in_a_bounded_line(value: Any, limit: int) -> None:
    for text in (bounds.describe(value), bounds.preview(value)):
        assert len(text) <= 4 * bounds.MAX_VALUE_CHARS + 40 and "\n" not in text
    cut = bounds.truncate(value, limit)
    # at most the limit; under a limit shorter than its own note, the note alone
    assert cut.isprintable() and len(cut) <= max(limit, 32)
    reason = bounds.bound_reason(value)
    assert reason.isprintable() and len(reason) <= bounds.MAX_REASON_CHARS


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(items=st.lists(st.one_of(st.text(), HUGE_TEXT), max_size=50), extra=LENGTHS)
def test_names_are_listed_bounded(items: list[str], extra: int) -> None:
    many = items + [f"n{i}" for i in range(extra)]
    text = bounds.names(many)
    shown = bounds.MAX_NAMES_SHOWN
    assert len(text) <= shown * (4 * bounds.MAX_NAME_CHARS + 4) + 40
    if len(many) > shown:
        assert f"({len(many) - shown:,} more)" in text


def test_the_descriptions_say_type_and_size() -> None:
    assert bounds.describe([0.5] * 1_000_000) == "list of 1,000,000 floats"
    assert bounds.describe(float("nan")) == "float nan"
    assert bounds.describe(10**5000) == "int of 16,610 bits"  # str() of it would raise
    assert bounds.describe("x" * 10**6).endswith("… (1,000,000 chars)")
    assert bounds.describe("a\nb") == r"str 'a\nb'"  # no forged log line
    assert bounds.truncate("y" * 10**6, 60).endswith("… (1,000,000 chars)")
    assert len(bounds.truncate("y" * 10**6, 60)) == 60
    assert bounds.names(["b", "a"]) == "['a', 'b']"
    assert bounds.names(str(i) for i in range(20_000)).endswith("... (19,995 more)]")
    assert bounds.bound_reason(ValueError("labels\nbad")) == r"labels\nbad"


# -- the documented caps -----------------------------------------------------------------------

DOC = ROOT / "docs" / "reference" / "input-bounds.md"
ROW = re.compile(
    r"^\|\s*`(?P<name>[A-Z_]+)`\s*\|\s*(?P<value>[0-9_,]+)\s*\|.*\|\s*`(?P<where>[^`]+)`\s*\|\s*$"
)


def _documented() -> dict[str, tuple[int, str]]:
    out = {}
    for line in DOC.read_text().splitlines():
        if (m := ROW.match(line)) is not None:
            out[m["name"]] = (int(m["value"].replace(",", "").replace("_", "")), m["where"])
    return out


def _caps() -> dict[str, int]:
    return {
        name: value
        for name, value in vars(bounds).items()
        if name.isupper() and isinstance(value, int) and not name.startswith("_")
    }


def test_the_caps_page_states_every_cap_and_its_value() -> None:
    documented = _documented()
    caps = _caps()
    assert caps, "edgefleet.bounds declares no caps"
    for name, value in caps.items():
        assert name in documented, f"{name} is missing from {DOC.name}'s table"
        assert documented[name][0] == value, (name, documented[name][0], value)
    for name, (value, where) in documented.items():
        module = where.split(":")[0].removesuffix(".py").replace("/", ".")
        actual = getattr(__import__(module, fromlist=[name]), name)
        assert actual == value, f"{DOC.name}: {name} = {value}, {where} says {actual}"
