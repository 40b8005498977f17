"""The device registry: which device is which, what it last said, what happened to it.

One :class:`DeviceRegistry` per run, owned by the round loop
(:class:`~edgefleet.loop.roundloop.RoundLoop`) and handed to every wrapper through the
round's :class:`~edgefleet.loop.context.RoundContext`. It is the only map between
Flower node ids and EdgeFleet's stable device ids: screening, status queries, sessions,
energy-aware selection and the results read and write it, and none keeps an identity map
of its own. It is checkpointed with the loop.

Binding. A node is bound to a device id by the first accepted claim of it: a status answer
or a train reply whose ``device-id`` passes :meth:`DeviceRegistry.screen`. A node, once
bound, speaks for that one device; a later claim of that id by another node is refused. An
id claimed by several nodes in one round while bound to none is bound to none of them: the
server cannot tell the device from the impostor.

Reconnects (``mode="reconnect"``): without SuperNode authentication a device that restarts
comes back under a new node id. Its claim is accepted, and the id moves to the new node,
once the old node is no longer online (Flower lists a dead node until its heartbeat
expires); the old node is retired and never asked again. So an impostor can take over the
id of a device that is offline, never of one that is online. With ``mode="strict"`` the id
never moves: use it with SuperNode authentication, where the SuperLink gives a registered
node the same node id every time it connects.

A node whose ClientApp cannot answer EdgeFleet's status query (Flower's quickstart has no
``@app.query()``) is *unreported*, one that answers without a ``device-id`` *anonymous*:
either is named ``node-<id>`` until a train reply of its claims a device id.

Telemetry. A status answer may carry a ``telemetry`` record (the energy mod adds one: battery
capacity, energy harvested and spent, CPU temperature, load, free memory, platform,
versions). It is device input like any other: :func:`screen_telemetry` keeps a value only
when its field is in :data:`TELEMETRY_FIELDS` and the value has the field's type and lies in
its bounds (a string: a short name of safe characters), so a NaN, a 10^9 temperature, a 1 MB
string or a list never reaches the registry, ``fleet.json`` or a page. What it drops is
logged once per device and field with the reason, counted in the round's
``telemetry_dropped`` column and kept (the reasons, not the values) on the device's record.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import log

from edgefleet.bounds import MAX_LABELS, bound_reason, describe, preview
from edgefleet.bounds import REJECTIONS_KEPT as REJECTIONS_KEPT  # declared with the other caps
from edgefleet.loop.timing import LinkEstimate
from edgefleet.wire import ENERGY_SPENT, LINK_KBPS


class BindingMode(StrEnum):
    """How a device id may move between nodes (``screening.device-binding``)."""

    RECONNECT = "reconnect"
    STRICT = "strict"


class RegistryError(ValueError):
    """A registry state that cannot be loaded, or a bad setting; the message says why."""


class FleetMismatch(RegistryError):
    """A resumed run's nodes come from another fleet than its checkpoint's."""


# -- telemetry -------------------------------------------------------------------------------


# A string value: a short name (architecture, accelerator, version), nothing a page or a
# metric label could choke on.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


@dataclass(frozen=True)
class TelemetryField:
    """One telemetry value a device may report: a number in [low, high], or a name."""

    kind: type  # float (an int is taken too) or str
    low: float = 0.0
    high: float = 0.0
    unit: str = ""


# Every field the server keeps, declared once: the mod sends these keys (edgefleet/client/
# mods.py ``device_telemetry``), the screening and fleet.json read them from here.
TELEMETRY_FIELDS: dict[str, TelemetryField] = {
    "battery-capacity": TelemetryField(float, 0.0, 1e6, "energy units"),
    "harvested": TelemetryField(float, 0.0, 1e6, "energy units since the last answer"),
    ENERGY_SPENT: TelemetryField(float, 0.0, 1e12, "energy units in all"),
    "cpu-temp-c": TelemetryField(float, -60.0, 200.0, "degrees C"),
    "load-1m": TelemetryField(float, 0.0, 1e4, "1-minute load average"),
    "mem-free-mb": TelemetryField(float, 0.0, 1e9, "MB available"),
    # what the operator declared of the device's link (``--node-config link-kbps=512``):
    # energy-age selection's deadline estimates a device's first round from it
    "link-kbps": TelemetryField(float, 1.0, 1e8, "declared link rate, kbit/s"),
    "arch": TelemetryField(str),
    "accelerator": TelemetryField(str),
    "edgefleet-version": TelemetryField(str),
    "flwr-version": TelemetryField(str),
}
UNKNOWN_FIELDS = "(unknown fields)"  # the reason's key for keys not in the table


@dataclass(frozen=True)
class Telemetry:
    """A status answer's telemetry after screening: the values kept, and the reason each
    dropped field was dropped (field -> reason)."""

    values: Mapping[str, float | str] = field(default_factory=dict)
    dropped: Mapping[str, str] = field(default_factory=dict)


def _check(spec: TelemetryField, value: object) -> float | str:
    """The value to keep, or raise ValueError with the reason."""
    if spec.kind is str:
        if not isinstance(value, str):
            raise ValueError(f"is a {type(value).__name__}, not a name")
        if not _NAME.fullmatch(value):
            raise ValueError(
                f"is not a name of at most 64 letters, digits or ._+- ({len(value)} chars)"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"is a {type(value).__name__}, not a number")
    # compared as sent (NaN and the infinities fail it), before float(): an int too large
    # for a float raises OverflowError there
    if not spec.low <= value <= spec.high:
        raise ValueError(f"{preview(value)} is not in [{spec.low:g}, {spec.high:g}]")
    return float(value)


def screen_telemetry(record: object) -> Telemetry:
    """The values of a ``telemetry`` record the server may keep (see :data:`TELEMETRY_FIELDS`);
    None (no record) is no telemetry. Never raises on what a device sent."""
    if record is None:
        return Telemetry()
    if not isinstance(record, Mapping):  # an ArrayRecord, say
        return Telemetry(
            dropped={UNKNOWN_FIELDS: f"a {type(record).__name__}, not a record of values"}
        )
    values: dict[str, float | str] = {}
    dropped: dict[str, str] = {}
    for key, spec in TELEMETRY_FIELDS.items():
        if key not in record:
            continue
        try:
            values[key] = _check(spec, record[key])
        except ValueError as why:
            dropped[key] = str(why)
    extra = sum(1 for key in record if key not in TELEMETRY_FIELDS)
    if extra:  # their names are the device's: not echoed
        dropped[UNKNOWN_FIELDS] = f"{extra} key(s) not in the telemetry table"
    return Telemetry(values, dropped)


# A battery level a device may report, in energy units: beyond this it is not a battery.
MAX_BATTERY = 1e6


def parse_battery(node: int, value: object) -> float | None:
    """A reported battery level, or None (absent; not a finite number in [0, MAX_BATTERY]:
    dropped with its reason, never stored)."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        log(WARNING, "Node %d: battery-level (%s) is not a number; dropped", node,
            describe(value))  # fmt: skip
        return None
    if not (0.0 <= value <= MAX_BATTERY):  # also NaN; no float(): an int may not fit one
        log(WARNING, "Node %d: battery-level (%s) is not in [0, %g]; dropped", node,
            describe(value), MAX_BATTERY)  # fmt: skip
        return None
    return float(value)


def parse_feasible(value: object) -> bool | None:
    """A reported ``feasible``: exactly 0 or 1 (a number), else None (malformed)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return None


@dataclass(frozen=True)
class EnergyState:
    """What a device last said of its energy: in answer to a status query or, after it
    trained, on its train reply (the energy mod adds ``battery-level`` and ``feasible``
    there too, so that energy-age selection can skip the next query: see
    ``EnergyAgeSelection``'s ``status_max_age``)."""

    round: int  # the round it was said in
    feasible: bool  # the battery covered a round then
    battery: float | None = None


@dataclass(frozen=True)
class DeviceStatus:
    """A device's answer to the light status query."""

    device: str  # the stable device id
    feasible: bool  # its battery covers a round
    present: bool  # it takes part in the current session
    labels: tuple[int, ...] = ()  # classes of its data (only when asked for)
    reported: bool = True  # False: the node does not answer status queries (assumed values)
    battery: float | None = None  # its battery level (energy units), when it reports one
    partitions: int | None = None  # the num-partitions its data was cut from, when reported
    telemetry: Telemetry = field(default_factory=Telemetry, compare=False)  # screened


@dataclass
class LastAnswer:
    """What a device last said: its status answer and the round of it, the classes of its
    data (from the last answer that named them), its energy."""

    status: DeviceStatus | None = None
    round: int = 0
    labels: tuple[int, ...] = ()
    # Not checkpointed (a resumed run asks again), and forgotten whenever a train message
    # goes to the device (that round may spend energy).
    energy: EnergyState | None = field(default=None, compare=False)


@dataclass
class Participation:
    """When a device took part: the last round it answered anything, the rounds its update
    was aggregated and the last such round (0: never)."""

    last_seen: int = 0
    count: int = 0
    last_trained: int = 0
    joined: int | None = None  # async: the version it joined at (participation weights)


@dataclass
class Outcomes:
    """What became of a device's train messages other than aggregation."""

    declines: int = 0
    unreachable: int = 0  # train messages the transport could not deliver or answer
    rejections: list[tuple[int, str]] = field(default_factory=list)  # newest last, bounded


@dataclass
class TelemetryLog:
    """A device's last accepted telemetry, and what screening dropped of it."""

    values: Mapping[str, float | str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # field -> last reason
    drops: int = 0  # values dropped in all


@dataclass
class SubmodelState:
    """CA-HFP: the share of the model's entries a device's last aggregated reply held (1.0:
    the full model; None: no reply under the pruning wrapper yet), and for the compact
    download the channels that reply kept (None: it was full-size, or none yet) and the
    last round the device was sent the full model."""

    kept_fraction: float | None = None
    kept_channels: dict[str, np.ndarray] | None = field(default=None, compare=False)
    full_sent: int | None = None


@dataclass
class DeviceRecord:
    """What the server knows of one device, by concern: who it is (``device``, ``node``),
    what it last said (``answer``), when it took part (``participation``), what else became
    of its train messages (``outcomes``), its telemetry, its link's timing (None: never
    timed) and its CA-HFP submodel."""

    device: str
    node: int
    answer: LastAnswer = field(default_factory=LastAnswer)
    participation: Participation = field(default_factory=Participation)
    outcomes: Outcomes = field(default_factory=Outcomes)
    telemetry: TelemetryLog = field(default_factory=TelemetryLog)
    link: LinkEstimate | None = None
    submodel: SubmodelState = field(default_factory=SubmodelState)

    def state_dict(self) -> dict[str, Any]:
        # Flat, as before the record was split by concern: checkpoints stay loadable both ways.
        sub = self.submodel
        out = {
            "node": self.node,
            "kept_fraction": sub.kept_fraction,
            "kept_channels": None
            if sub.kept_channels is None
            else {g: [int(i) for i in idx] for g, idx in sub.kept_channels.items()},
            "full_sent": sub.full_sent,
            "link": None if self.link is None else self.link.state_dict(),
            "labels": list(self.answer.labels),
            "last_seen": self.participation.last_seen,
            "participations": self.participation.count,
            "last_trained": self.participation.last_trained,
            "declines": self.outcomes.declines,
            "unreachable": self.outcomes.unreachable,
            "rejections": [list(r) for r in self.outcomes.rejections],
        }
        if self.participation.joined is not None:  # async participation weights only
            out["joined"] = self.participation.joined
        return out


def _version(value: Any) -> int:
    # isinstance, not int(): int(inf) raises OverflowError, which the loader does not catch
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a version must be an integer >= 0, not {value!r}")
    return value


class DeviceRegistry:
    """Node <-> device binding, the last status of each device, and its history."""

    def __init__(self, mode: str = BindingMode.RECONNECT) -> None:
        try:
            self.mode = BindingMode(mode)
        except ValueError:
            valid = ", ".join(m.value for m in BindingMode)
            raise RegistryError(f"device binding {mode!r}; valid: {valid}") from None
        self.devices: dict[str, DeviceRecord] = {}
        self._node_device: dict[int, str] = {}
        self.retired: set[int] = set()  # nodes superseded by a newer node of their device
        self.unreported: set[int] = set()  # nodes that cannot answer status queries
        self.anonymous: set[int] = set()  # nodes that answer them without a device id
        self.heard: set[int] = set()  # nodes that have answered a status query (anything)
        # The fleet's partitioning (num-partitions its devices report), fixed by the most
        # common value of the run's first answers; None while no device has reported one.
        self.partitions: int | None = None
        self.resumed = False  # loaded from a checkpoint
        self._devices_checked = False  # a resumed run's fleet checked by device ids

    # -- identity -------------------------------------------------------------------------

    def device_of(self, node: int) -> str | None:
        """The device ``node`` is bound to, or None."""
        return self._node_device.get(node)

    def node_of(self, device: str) -> int | None:
        record = self.devices.get(device)
        return None if record is None else record.node

    def known(self, node: int) -> bool:
        """Whether ``node`` has a name from its own status answers (bound, or known by its
        node id because it cannot report one)."""
        return node in self._node_device or node in self.unreported or node in self.anonymous

    def name(self, node: int, claimed: str | None = None) -> str:
        """How logs and rows name ``node``: its bound device, else the id it claims, else
        ``node-<id>``."""
        bound = self._node_device.get(node)
        if bound is not None:
            return bound
        return claimed if claimed is not None else f"node-{node}"

    def screen(
        self, claims: Mapping[Any, tuple[int, str]], online: Callable[[], set[int]]
    ) -> dict[Any, str]:
        """Reasons to refuse, by the key of each claim (``key -> (node, device id)``); the
        claims not named may be bound with :meth:`bind` once accepted."""
        claimants: dict[str, set[int]] = {}
        for node, device in claims.values():
            claimants.setdefault(device, set()).add(node)
        nodes_online: set[int] | None = None
        reasons: dict[Any, str] = {}
        for key, (node, device) in claims.items():
            own = self._node_device.get(node)
            bound = self.node_of(device)
            others = sorted(claimants[device] - {node})
            if own is not None and own != device:
                reasons[key] = (
                    f"node {node} speaks for device {own} in this run and now claims "
                    f"device-id {device}"
                )
            elif bound is None:
                if others:
                    reasons[key] = (
                        f"device-id {device} is claimed by nodes {sorted(claimants[device])} "
                        "in the same round and bound to none of them"
                    )
            elif bound != node:
                if self.mode is BindingMode.STRICT:
                    reasons[key] = f"device-id {device} is bound to node {bound}"
                    continue
                if nodes_online is None:
                    nodes_online = online()
                if bound in nodes_online:
                    reasons[key] = f"device-id {device} is bound to node {bound}, still online"
                elif others:
                    reasons[key] = (
                        f"device-id {device} (its node {bound} is offline) is claimed by nodes "
                        f"{sorted(claimants[device])} in the same round"
                    )
        return reasons

    def bind(self, node: int, device: str) -> DeviceRecord:
        """Bind ``node`` to ``device`` (a claim :meth:`screen` accepted); a device that moves
        retires its old node."""
        record = self.devices.get(device)
        if record is None:
            record = self.devices[device] = DeviceRecord(device, node)
        elif record.node != node:
            log(INFO, "Device %s now speaks through node %d (was node %d)", device, node,
                record.node)  # fmt: skip
            self._node_device.pop(record.node, None)
            self.retired.add(record.node)
            record.node = node
        self._node_device[node] = device
        self.retired.discard(node)
        return record

    def check_fleet(self, reported: dict[int, int]) -> dict[int, str]:
        """Reasons to refuse status answers whose ``num-partitions`` (node -> value) is not
        the fleet's. The first answers fix the fleet's value (the most common one, so that
        a few hostile answers cannot); answers that disagree are refused. A resumed run whose
        answers mostly disagree with its checkpoint's fleet raises :class:`FleetMismatch`:
        resume continues the same run, on the same fleet, or refuses."""
        if not reported:
            return {}
        values = sorted(reported.values())
        common = max(set(values), key=lambda v: (values.count(v), -v))
        if self.partitions is None:
            self.partitions = common
        elif common != self.partitions and self.resumed and values.count(common) * 2 > len(values):
            raise FleetMismatch(
                f"this run was checkpointed on a fleet of {self.partitions} partitions; "
                f"{values.count(common)} of {len(values)} nodes now report num-partitions "
                f"{common}. A resume continues the same run on the same fleet: start this "
                "fleet under another run-name"
            )
        return {
            node: f"reports num-partitions {value}, this run's fleet has {self.partitions}"
            for node, value in reported.items()
            if value != self.partitions
        }

    def check_devices(self, claimed: Iterable[str]) -> None:
        """On a resumed run, the first status answers that name devices (their own
        ``device-id``s) must include one the checkpoint knows: a fleet none of whose devices
        this run has seen is another fleet (:class:`FleetMismatch`), whatever its
        partitioning. Checked once; devices that join later are new devices of this fleet."""
        claimed = set(claimed)
        if not self.resumed or self._devices_checked or not self.devices or not claimed:
            return
        self._devices_checked = True
        if claimed.isdisjoint(self.devices):

            def some(names: Iterable[str]) -> str:
                names = sorted(names)
                return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")

            raise FleetMismatch(
                f"this run was checkpointed with {len(self.devices)} devices "
                f"({some(self.devices)}); none of the {len(claimed)} devices answering now "
                f"({some(claimed)}) is one of them. A resume continues the same run on the "
                "same fleet: start this fleet under another run-name"
            )

    # -- what devices said and what happened to them ---------------------------------------

    def note_status(self, rnd: int, node: int, status: DeviceStatus) -> None:
        """Keep an accepted status answer of a bound (reported) node."""
        record = self.devices[status.device]
        record.answer.status, record.answer.round, record.participation.last_seen = status, rnd, rnd
        if status.reported:
            record.answer.energy = EnergyState(rnd, status.feasible, status.battery)
        if status.labels:
            record.answer.labels = status.labels
        telemetry = status.telemetry
        if telemetry.values:
            record.telemetry.values = dict(telemetry.values)
        if telemetry.dropped:
            new = sorted(set(telemetry.dropped) - set(record.telemetry.dropped))
            if new:  # once per device and field: a device that keeps sending it is not news
                why = "; ".join(f"{k} {telemetry.dropped[k]}" for k in new)
                log(WARNING, "Device %s: telemetry dropped (not kept): %s", status.device, why)
            record.telemetry.dropped.update(telemetry.dropped)
            record.telemetry.drops += len(telemetry.dropped)

    def note_energy(self, device: str, state: EnergyState | None) -> None:
        """``device``'s energy as its train reply gave it (None: unknown: a train message
        went out and no reply told what it cost). A name with no record is not kept."""
        if (record := self.devices.get(device)) is not None:
            record.answer.energy = state

    def status_round(self, device: str) -> int:
        """The round of ``device``'s last status answer (0: none)."""
        record = self.devices.get(device)
        return 0 if record is None else record.answer.round

    def energy(self, device: str) -> EnergyState | None:
        """``device``'s last energy answer (None: none since its last train message)."""
        record = self.devices.get(device)
        return None if record is None else record.answer.energy

    def declared_kbps(self, device: str) -> float | None:
        """The link rate ``device`` declared in its telemetry (``link-kbps``), or None."""
        record = self.devices.get(device)
        value = None if record is None else record.telemetry.values.get(LINK_KBPS)
        return float(value) if isinstance(value, int | float) else None

    def timing(self, device: str) -> LinkEstimate:
        """The round timing of bound ``device`` (made on first use), for the loop to add to."""
        record = self.devices[device]
        record.link = record.link or LinkEstimate()
        return record.link

    def note_timing(self, device: str, elapsed: float, nbytes: int, compute: float | None) -> None:
        """A reply of ``device`` came ``elapsed`` s after its message; the round moved
        ``nbytes`` and the device says it trained ``compute`` s (None: it does not say). A
        name with no record (not bound) is not kept."""
        if device in self.devices:
            self.timing(device).observe(elapsed, nbytes, compute)

    def note_kept_fraction(self, device: str, fraction: float) -> None:
        """``device``'s last aggregated CA-HFP reply held ``fraction`` of the model's
        parameters; a value outside [0, 1] (the device reports it) is not kept."""
        record = self.devices.get(device)
        if record is not None and math.isfinite(fraction) and 0.0 <= fraction <= 1.0:
            record.submodel.kept_fraction = round(float(fraction), 4)

    def note_kept_channels(self, device: str, kept: dict[str, np.ndarray] | None) -> None:
        """CA-HFP: the channels ``device``'s aggregated reply kept (None: a full-size one)."""
        record = self.devices.get(device)
        if record is not None:
            record.submodel.kept_channels = kept

    def note_full_sent(self, device: str, rnd: int) -> None:
        """CA-HFP's compact download sent ``device`` the full model in round ``rnd``."""
        record = self.devices.get(device)
        if record is not None:
            record.submodel.full_sent = rnd

    def compact_state(self, device: str) -> tuple[dict[str, np.ndarray] | None, int | None]:
        """CA-HFP's compact-download state of ``device``: the channels its last aggregated
        reply kept and the last round it was sent the full model (None: none yet)."""
        record = self.devices.get(device)
        return (
            (None, None)
            if record is None
            else (record.submodel.kept_channels, record.submodel.full_sent)
        )

    def link(self, device: str) -> LinkEstimate | None:
        """What the server has timed of ``device``'s rounds (None: nothing yet)."""
        record = self.devices.get(device)
        return None if record is None else record.link

    def labels(self, device: str) -> tuple[int, ...]:
        record = self.devices.get(device)
        return () if record is None else record.answer.labels

    def note_joined(self, device: str, version: int) -> None:
        """Async participation weights: ``device`` joined the fleet at ``version`` (kept
        from its first update; a name not bound has no record to keep it)."""
        if (record := self.devices.get(device)) is not None and record.participation.joined is None:
            record.participation.joined = version

    def note_round(
        self,
        rnd: int,
        participants: Iterable[str],
        declined: Iterable[str],
        rejected: Iterable[Mapping[str, str]],
        unreachable: Iterable[str] = (),
    ) -> None:
        """Add a round's outcome to the devices' histories (names not bound are skipped:
        an unbound node has no record to keep). An unreachable device is neither seen nor
        counted as declining."""
        for device in participants:
            if (record := self.devices.get(device)) is not None:
                record.participation.count += 1
                record.participation.last_trained = record.participation.last_seen = rnd
        for device in declined:
            if (record := self.devices.get(device)) is not None:
                record.outcomes.declines += 1
                record.participation.last_seen = rnd
        for item in rejected:
            if (record := self.devices.get(item["device"])) is not None:
                reason = bound_reason(item["reason"])  # the loop's are; a caller's may not be
                record.outcomes.rejections = [*record.outcomes.rejections, (rnd, reason)][
                    -REJECTIONS_KEPT:
                ]
        for device in unreachable:
            if (record := self.devices.get(device)) is not None:
                record.outcomes.unreachable += 1

    # -- checkpoint ------------------------------------------------------------------------

    def snapshot(self, online: set[int]) -> list[dict[str, Any]]:
        """Every device as the fleet view shows it (JSON-ready), in device order."""
        out = []
        for device in sorted(self.devices, key=_natural):
            r = self.devices[device]
            status = r.answer.status
            # a train reply's energy is newer than the last status answer when reused
            energy = (
                r.answer.energy
                if r.answer.energy is not None and r.answer.energy.round > r.answer.round
                else None
            )
            out.append(
                {
                    "device": device,
                    "node": r.node,
                    "online": r.node in online and r.node not in self.retired,
                    "last_seen": r.participation.last_seen,
                    "battery": energy.battery
                    if energy is not None
                    else (None if status is None else status.battery),
                    "feasible": energy.feasible
                    if energy is not None
                    else (None if status is None else status.feasible),
                    "present": None if status is None else status.present,
                    "status_round": r.answer.round,
                    "labels": list(r.answer.labels),
                    "participations": r.participation.count,
                    "last_trained": r.participation.last_trained,
                    "declines": r.outcomes.declines,
                    "unreachable": r.outcomes.unreachable,
                    "rejections": [
                        {"round": a, "reason": b} for a, b in r.outcomes.rejections[-5:]
                    ],
                    "telemetry": dict(r.telemetry.values),
                    "telemetry_dropped": dict(r.telemetry.dropped),
                    "link": None if r.link is None else r.link.view(),
                    "kept_fraction": r.submodel.kept_fraction,
                }
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "devices": {d: r.state_dict() for d, r in self.devices.items()},
            "retired": sorted(self.retired),
            "unreported": sorted(self.unreported),
            "anonymous": sorted(self.anonymous),
            "heard": sorted(self.heard),
            "partitions": self.partitions,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            records = dict(state.get("devices", {}))
            devices = {
                str(d): DeviceRecord(
                    device=str(d),
                    node=int(r["node"]),
                    answer=LastAnswer(
                        labels=tuple(int(c) for c in r.get("labels", []))[:MAX_LABELS]
                    ),
                    participation=Participation(
                        last_seen=int(r.get("last_seen", 0)),
                        count=int(r.get("participations", 0)),
                        last_trained=int(r.get("last_trained", 0)),
                        joined=None if r.get("joined") is None else _version(r["joined"]),
                    ),
                    outcomes=Outcomes(
                        declines=int(r.get("declines", 0)),
                        unreachable=int(r.get("unreachable", 0)),  # absent before issue 42
                        rejections=[(int(a), bound_reason(b)) for a, b in r.get("rejections", [])][
                            -REJECTIONS_KEPT:
                        ],
                    ),
                    link=None if r.get("link") is None else LinkEstimate.from_state(r["link"]),
                    submodel=SubmodelState(
                        kept_fraction=None
                        if r.get("kept_fraction") is None
                        else float(r["kept_fraction"]),
                        # absent from checkpoints before the kept channels were kept here
                        kept_channels=None
                        if r.get("kept_channels") is None
                        else {
                            str(g): np.asarray([int(i) for i in idx], dtype=np.int64)
                            for g, idx in dict(r["kept_channels"]).items()
                        },
                        full_sent=None if r.get("full_sent") is None else int(r["full_sent"]),
                    ),
                )
                for d, r in records.items()
            }
            retired = {int(n) for n in state.get("retired", [])}
            unreported = {int(n) for n in state.get("unreported", [])}
            anonymous = {int(n) for n in state.get("anonymous", [])}
            heard = {int(n) for n in state.get("heard", [])}
            partitions = state.get("partitions")
            partitions = None if partitions is None else int(partitions)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RegistryError(f"device registry state is malformed: {err!r}") from None
        self.devices = devices
        self._node_device = {r.node: d for d, r in devices.items()}
        self.retired, self.unreported, self.heard = retired, unreported, heard
        self.anonymous, self.partitions, self.resumed = anonymous, partitions, True


def _natural(device: str) -> tuple[int, int | str]:
    return (0, int(device)) if device.isdigit() else (1, device)
