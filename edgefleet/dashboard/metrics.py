"""``/metrics``: the run folder in Prometheus' text exposition format.

Each exposition is built in a fresh :class:`~prometheus_client.CollectorRegistry` holding one
:class:`RunCollector` over the run folder's files, so the exporter has no state of its own
(no global registry, nothing to reset when a run is resumed or replaced): what Prometheus
reads is what ``fleet.json`` and ``metrics.jsonl`` say at that moment. (The dashboard keeps the
last exposition while both files hold the same bytes: see ``app.py``.)

Per device (label ``device``): battery, online, last round seen, participations, declines,
last round trained, and any other numeric field the server adds to a device's entry
(telemetry), as ``edgefleet_device_<field>``: a field's hyphens become underscores (the
devices' telemetry is spelled ``load-1m``, ``cpu-temp-c``, ``link-kbps``: the gauge is
``edgefleet_device_telemetry_load_1m``), and a field whose name has any other character a
Prometheus name cannot hold is left out (:func:`metric_name`). Not of every device
``fleet.json`` names (the server never forgets one): a device offline for more than
``offline_rounds`` rounds leaves, and of the rest at most ``max_devices`` are exported (online
first, then the most recently seen), within :data:`MAX_DEVICE_SAMPLES` samples;
``edgefleet_devices`` (all known) beside ``edgefleet_devices_exported`` and
``edgefleet_devices_export_limit`` shows the cut. Counters over the rows: rounds, replies
accepted, declined, unreachable and rejected (by reason), bytes up and down, energy spent.
Run gauges: round, session, accuracy and loss, task-vector growth and its tau, devices known
and online; in an asynchronous run also the last version's staleness (median, max) and the
devices in flight.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edgefleet.dashboard.data import device_id, number, read_fleet, read_rounds

PREFIX = "edgefleet"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Per-device fields with a metric of their own (name, help); any other numeric field of a
# device entry becomes a generic gauge.
DEVICE_GAUGES = {
    "battery": "battery level the device last reported (energy units)",
    "online": "1 if the device's node is connected now, else 0",
    "last_seen": "last round the server heard from the device",
    "participations": "rounds in which the device's update was aggregated",
    "declines": "train messages the device declined",
    "unreachable": "train messages the transport could not deliver to the device",
    "last_trained": "last round the device's update was aggregated (0: never)",
}
SKIP = {"node"}  # an id, not a measure
MAX_EXTRA = 64  # generic per-device gauges at most: a field name is server-made, but bounded
MAX_REASONS = 20  # rejection reasons as label values at most (the rest: "other")
NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Per scrape, so that a fleet of any size costs a bounded exposition (5,000 devices made
# 2.27 MB, 40,089 samples, a scrape): docs/reference/service-limits.md.
MAX_DEVICES = 1000  # devices exported at most (the default; the dashboard's --metrics-max-devices)
OFFLINE_ROUNDS = 10  # rounds offline after which a device leaves (--metrics-offline-rounds)
MAX_DEVICE_SAMPLES = 16384  # per-device samples at most, whole devices only
MAX_LABEL = 128  # characters of a device id as a label value


def reason_kind(reason: str) -> str:
    """A rejection reason without the values it quotes (a reason names what a device sent),
    so that one label value stands for one kind of rejection, not one per reply."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", str(reason))
    text = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:80] or "unspecified"


class RunCollector(Collector):
    """The metrics of one run folder's ``fleet.json`` and rows, as read for one scrape."""

    def __init__(
        self,
        fleet: dict[str, Any],
        rows: list[dict[str, Any]],
        *,
        max_devices: int = MAX_DEVICES,
        offline_rounds: int = OFFLINE_ROUNDS,
    ) -> None:
        self.fleet, self.rows = fleet, rows
        self.max_devices, self.offline_rounds = max_devices, offline_rounds
        self.exported = 0

    def collect(self) -> Iterator[Metric]:
        yield from self._devices(self.fleet.get("devices", []))
        yield from self._counters(self.rows)
        yield from self._run(self.fleet, self.rows)

    def _devices(self, devices: list[dict[str, Any]]) -> Iterator[Metric]:
        families = {
            key: GaugeMetricFamily(f"{PREFIX}_device_{key}", text, labels=["device"])
            for key, text in DEVICE_GAUGES.items()
        }
        extra: dict[str, GaugeMetricFamily] = {}
        samples = 0
        chosen = exported_devices(
            devices, number(self.fleet.get("round")), self.max_devices, self.offline_rounds
        )
        for name, device in chosen:
            fields = [(k, v) for k, v in _numeric_fields(device) if k not in SKIP]
            if samples + len(fields) > MAX_DEVICE_SAMPLES:
                break  # whole devices only: a device's series are all there or none
            self.exported += 1
            for key, value in fields:
                family = families.get(key) or extra.get(key)
                if family is None:
                    if len(extra) >= MAX_EXTRA:
                        continue
                    family = extra[key] = GaugeMetricFamily(
                        f"{PREFIX}_device_{key}",
                        f"device field {key!r} of fleet.json",
                        labels=["device"],
                    )
                family.add_metric([name], value)
                samples += 1
        yield from families.values()
        yield from extra.values()

    def _counters(self, rows: list[dict[str, Any]]) -> Iterator[Metric]:
        def total(name: str, text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", text, value=value)

        def count(key: str) -> int:
            return sum(len(r[key]) for r in rows if isinstance(r.get(key), list))

        def add(key: str) -> float:
            return sum(v for r in rows if (v := number(r.get(key))) is not None)

        yield total("rounds", "rounds run (rows of metrics.jsonl)", len(rows))
        yield total("replies_accepted", "train replies aggregated", count("participants"))
        yield total("replies_declined", "train messages declined by devices", count("declined"))
        yield total(
            "replies_unreachable",
            "train messages to devices the transport could not reach (node unavailable)",
            count("unreachable"),
        )
        reasons: Counter[str] = Counter()
        for row in rows:
            for item in row.get("rejected") or []:
                if isinstance(item, dict):
                    reasons[reason_kind(item.get("reason", ""))] += 1
        rejected = CounterMetricFamily(
            f"{PREFIX}_replies_rejected",
            "train replies the server's screening dropped, by reason",
            labels=["reason"],
        )
        kept = reasons.most_common(MAX_REASONS)
        for reason, n in kept:
            rejected.add_metric([reason], n)
        other = sum(reasons.values()) - sum(n for _, n in kept)
        if other:
            rejected.add_metric(["other"], other)
        yield rejected
        for key in ("bytes_up", "bytes_down"):
            if any(key in r for r in rows):
                yield total(key, f"{key.replace('_', ' ')} over all rounds", add(key))
        if any("energy_spent" in r for r in rows):
            yield total(
                "energy_spent", "energy units the devices spent training", add("energy_spent")
            )

    def _run(self, fleet: dict[str, Any], rows: list[dict[str, Any]]) -> Iterator[Metric]:
        last = rows[-1] if rows else {}
        devices = fleet.get("devices", [])
        values = {
            "round": ("the last round run", number(fleet.get("round", last.get("round")))),
            "session": (
                "the session the fleet is in",
                number(fleet.get("session", last.get("session"))),
            ),
            "test_accuracy": (
                "central test accuracy of the last evaluated round",
                _last(rows, "test_accuracy") if rows else number(fleet.get("test_accuracy")),
            ),
            "test_loss": (
                "central test loss of the last evaluated round",
                _last(rows, "test_loss"),
            ),
            "task_vector_growth": (
                "data-free stopping signal: the task vector's relative growth",
                number(fleet.get("task_vector_growth")),
            ),
            "stopping_tau": (
                "the growth below which data-free stopping counts a plateau",
                number(fleet.get("stopping_tau")),
            ),
            # Asynchronous aggregation (a row per version): the last version's figures.
            "staleness_median": (
                "median staleness (versions) of the updates in the last version's buffer",
                _last(rows, "staleness_median"),
            ),
            "staleness_max": (
                "largest staleness (versions) of an update in the last version's buffer",
                _last(rows, "staleness_max"),
            ),
            "in_flight": (
                "devices training when the last version was made",
                _last(rows, "in_flight"),
            ),
            "devices": ("devices the server knows", float(len(devices))),
            "devices_exported": (
                "devices with per-device series in this scrape (offline ones leave, and "
                "there is a cap)",
                float(self.exported),
            ),
            "devices_export_limit": (
                "devices exported at most (the cap of edgefleet_devices_exported)",
                float(self.max_devices),
            ),
            "devices_online": (
                "devices whose node is connected",
                float(sum(1 for d in devices if d.get("online") is True)),
            ),
            "fleet_written_timestamp_seconds": (
                "when the server last wrote fleet.json",
                number(fleet.get("written_at")),
            ),
        }
        for key, (text, value) in values.items():
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{key}", text, value=value)


def exported_devices(
    devices: list[dict[str, Any]],
    fleet_round: float | None,
    max_devices: int = MAX_DEVICES,
    offline_rounds: int = OFFLINE_ROUNDS,
) -> list[tuple[str, dict[str, Any]]]:
    """The devices of ``fleet.json`` that get series, with their label values: each id once
    (cut to :data:`MAX_LABEL` characters); none offline for more than ``offline_rounds``
    rounds before ``fleet_round`` (one never seen counts as long gone); online first, then
    the most recently seen, at most ``max_devices``."""
    kept: list[tuple[bool, float, str, dict[str, Any]]] = []
    seen: set[str] = set()
    for device in devices:
        name = device_id(device)[:MAX_LABEL]
        if name in seen:  # one sample per label set, or the exposition is invalid
            continue
        seen.add(name)
        online = device.get("online") is True
        last = number(device.get("last_seen"))
        gone = last is None or (fleet_round is not None and fleet_round - last > offline_rounds)
        if not online and fleet_round is not None and gone:
            continue
        kept.append((online, -1.0 if last is None else last, name, device))
    kept.sort(key=lambda k: (not k[0], -k[1]))  # stable: ties keep the file's order
    return [(name, device) for _, _, name, device in kept[: max(0, max_devices)]]


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    for row in reversed(rows):
        if (v := number(row.get(key))) is not None:
            return v
    return None


def metric_name(field: str) -> str | None:
    """The metric-name part for a ``fleet.json`` field: lower case, hyphens as underscores
    (``load-1m`` -> ``load_1m``); None for a name with any other character outside
    ``[a-z0-9_]`` (or too long), which is refused rather than guessed at."""
    name = field.lower().replace("-", "_")
    return name if NAME.match(name) else None


def _numeric_fields(device: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """A device entry's numeric fields, one level of nesting flattened (``telemetry.load-1m``
    is ``telemetry_load_1m``); bools as 0/1, anything else (strings, NaN) left out, and a
    second field that maps to a name already given too (one sample per name and device)."""
    seen: set[str] = set()

    def field(key: str, value: Any) -> tuple[str, float] | None:
        name = metric_name(key)
        v = 1.0 if value is True else 0.0 if value is False else number(value)
        if v is None or name is None or name in seen:
            return None
        seen.add(name)
        return name, v

    for key, value in device.items():
        if not isinstance(key, str):
            continue
        if isinstance(value, dict):
            for sub, inner in value.items():
                if isinstance(sub, str) and (item := field(f"{key}_{sub}", inner)) is not None:
                    yield item
            continue
        if (item := field(key, value)) is not None:
            yield item


def render(run_dir: Path, **limits: int) -> bytes:
    """The exposition of ``run_dir`` now, from a registry made for this scrape."""
    return render_data(read_fleet(run_dir), read_rounds(run_dir), **limits)


def render_data(
    fleet: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    max_devices: int = MAX_DEVICES,
    offline_rounds: int = OFFLINE_ROUNDS,
) -> bytes:
    """The exposition of a run's parsed ``fleet.json`` and rows (``max_devices``,
    ``offline_rounds``: which devices get series, :func:`exported_devices`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        RunCollector(fleet, rows, max_devices=max_devices, offline_rounds=offline_rounds)
    )
    return generate_latest(registry)
