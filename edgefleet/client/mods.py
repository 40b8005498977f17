"""A device's energy-harvesting battery as a Flower mod any ClientApp can add (EH-FedSAG).

Add it to your own ClientApp (see docs/reference/library.md, "The library in your own
Flower app")::

    from edgefleet.client.mods import energy_mod, status_query

    app = ClientApp(mods=[energy_mod(capacity=10, harvest_prob=0.3)])
    app.query()(status_query)  # only if your app has no query function of its own

and wrap your server strategy in ``EnergyAgeSelection``. The mod acts on EdgeFleet's
messages only and passes every other message through untouched:

- **Status query** (a ``query`` message whose ``config`` record holds the server's ``slot``):
  the battery is advanced to that slot, the app's query function answers (``status_query``,
  EdgeFleet's own, or yours), and the mod adds ``battery-level`` and ``feasible`` (the battery
  covers a round) to the reply's ``status`` record, making one if the function gave none,
  and the device's telemetry as a ``telemetry`` config record (:func:`device_telemetry`).
- **Train message with a ``slot``** (sent under energy-aware selection): the battery is
  advanced; if it cannot pay for the round, the device declines with an ``Error`` and spends
  nothing; otherwise the app trains, and only a successful reply is charged (Omega training
  slots + 1 transmission slot) and gets an ``energy-spent`` metric, and an ``energy``
  ConfigRecord with ``battery-level`` and ``feasible`` after paying (the server may take them
  for the device's next status answer instead of asking: ``selection.status-max-age``;
  Flower's strategies aggregate only the ArrayRecord and the MetricRecord). A train function that
  declines (an ``Error``) spends nothing, so "decline before any energy is spent" holds.

Why the query line: Flower applies a ClientApp's mods only around the functions it has
registered, and answers any other message type with an error before a mod sees it. So a
ClientApp without a query function never lets the mod answer a status query; the server
then says so once and takes the node as feasible, while the mod still declines a train
message the battery cannot pay for.

The battery (level, slot, energy spent) lives in ``Context.state``, which Flower keeps
between messages in simulation and on a SuperNode; the energy source is rebuilt from the
settings each message, which is exact because arrivals are a function of (seed, slot).
A ``device-id`` in the node config is reported in status answers and train metrics, so the
server keys the device's age and memory by it rather than by the node id.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import platform
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import MessageType

from edgefleet.client.battery import (
    Battery,
    ClockError,
    EnergyConfigError,
    EnergySource,
    SourceUnavailableError,
    make_source,
)
from edgefleet.wire import (  # the protocol's names, one spelling for both sides
    BATTERY_LEVEL,
    DEVICE_ID,
    ENERGY_RECORD,
    ENERGY_SPENT,
    FEASIBLE,
    LINK_KBPS,
    NUM_PARTITIONS,
    PRESENT,
    STATUS_RECORD,
    TELEMETRY_RECORD,
)

# Error codes in EdgeFleet's client replies; the server logs the reason either way.
ERR_BAD_CONFIG = 10
ERR_TRAIN_FAILED = 11
ERR_NO_ENERGY = 12
ERR_ABSENT = 13
ERR_NO_TEACHER = 14  # warm start's continuous mode: this device does not hold the teacher

STATE_KEY = "edgefleet.battery"
HARVEST_KEY = "edgefleet.harvested"  # energy harvested since the last status answer


@dataclass(frozen=True)
class BatterySettings:
    """What the mod needs to know of a device: its battery size, energy source and the cost
    of one round in energy units (Omega training slots + 1 transmission slot)."""

    capacity: float
    source: EnergySource
    round_cost: float


# Builds a device's settings from its Context (run config, node config); raising one of
# SETTINGS_ERRORS turns into an Error reply naming the problem.
SettingsFn = Callable[[Context], BatterySettings]
SETTINGS_ERRORS = (ValueError, FileNotFoundError, SourceUnavailableError)


def device_seed(context: Context, base: int = 0) -> int:
    """A stable seed for the device's energy arrivals: from its ``device-id`` or
    ``partition-id`` node config if set, else its node id (stable for a SuperNode's life)."""
    node = context.node_config
    ident = node.get(DEVICE_ID, node.get("partition-id", context.node_id))
    return zlib.crc32(f"{base}:{ident}".encode())


def energy_mod(
    capacity: float = 10.0,
    harvest_prob: float = 0.5,
    harvest_units: float = 1.0,
    train_slots: int = 3,
    source: str = "bernoulli",
    trace_path: str = "",
    seed: int = 0,
    *,
    settings: SettingsFn | None = None,
) -> Mod:
    """The battery mod, for a device with these settings (or ``settings(context)``, which
    EdgeFleet's own ClientApp derives from the run and node config).

    ``source``: ``bernoulli`` (an arrival of ``harvest_units`` with probability
    ``harvest_prob`` per slot, seeded per device from ``seed``), ``trace`` (``trace_path``),
    ``always-on`` or ``sysfs`` (the board's real battery). Bad settings raise here, before
    any message is handled.
    """
    if settings is None:
        cost = Battery.round_cost(train_slots)
        if not capacity >= cost and source != "always-on":
            raise EnergyConfigError(
                f"energy_mod: capacity={capacity} is below one round's cost {cost:g} "
                "(train_slots + 1): this device could never train"
            )
        # Built (and so checked) once: a trace file is read here, not on every message.
        if source == "bernoulli":
            shared = make_source("bernoulli", seed=0, prob=harvest_prob, units=harvest_units)
        elif source == "trace":
            shared = make_source("trace", path=trace_path)
        else:
            shared = make_source(source)

        def fixed(context: Context) -> BatterySettings:
            src = shared
            if source == "bernoulli":  # arrivals differ per device: seed it by the device
                src = make_source(
                    "bernoulli",
                    seed=device_seed(context, seed),
                    prob=harvest_prob,
                    units=harvest_units,
                )
            return BatterySettings(float(capacity), src, cost)

        settings = fixed
    return _EnergyMod(settings)


class _EnergyMod:
    def __init__(self, settings: SettingsFn) -> None:
        self.settings = settings

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        slot = _slot(msg)
        if slot is None:
            return call_next(msg, context)
        try:
            settings = self.settings(context)
            battery = load_battery(settings, context)
            before = battery.level
            battery.advance(slot)
        except (*SETTINGS_ERRORS, ClockError) as err:
            return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
        save_battery(battery, context)
        _note_harvest(context, battery.level - before)
        kind = msg.metadata.message_type.split(".")[0]
        if kind == MessageType.QUERY:
            return self._status(msg, context, call_next, battery, settings)
        if kind == MessageType.TRAIN:
            return self._train(msg, context, call_next, battery, settings)
        return call_next(msg, context)

    def _status(
        self,
        msg: Message,
        context: Context,
        call_next: ClientAppCallable,
        battery: Battery,
        settings: BatterySettings,
    ) -> Message:
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        status = reply.content.metric_records.get(STATUS_RECORD)
        fields: dict[str, Any] = dict(status) if status is not None else {PRESENT: 1}
        fields.update(
            {
                BATTERY_LEVEL: float(battery.level),
                FEASIBLE: int(battery.can_afford(settings.round_cost)),
            }
        )
        _add_device_id(fields, context)
        content = RecordDict({STATUS_RECORD: MetricRecord(fields)})
        telemetry = device_telemetry(battery, _take_harvest(context))
        content[TELEMETRY_RECORD] = ConfigRecord({**telemetry, **_declared_link(context)})
        return Message(content, reply_to=msg)

    def _train(
        self,
        msg: Message,
        context: Context,
        call_next: ClientAppCallable,
        battery: Battery,
        settings: BatterySettings,
    ) -> Message:
        cost = settings.round_cost
        if not battery.can_afford(cost):
            reason = f"battery {battery.level:.2f} < round cost {cost:g}"
            return Message(Error(ERR_NO_ENERGY, reason), reply_to=msg)
        reply = call_next(msg, context)
        if reply.has_error() or len(reply.content.metric_records) != 1:
            return reply  # declined or malformed: nothing spent, the server screens it
        battery.spend(cost)
        save_battery(battery, context)
        name, metrics = next(iter(reply.content.metric_records.items()))
        fields: dict[str, Any] = {**dict(metrics), ENERGY_SPENT: cost}
        _add_device_id(fields, context, status=False)
        reply.content[name] = MetricRecord(fields)
        # What the battery holds after paying, in a record of its own (not averaged with
        # the app's metrics): the server may take it as this device's status for the next
        # round instead of asking (selection.status-max-age).
        reply.content[ENERGY_RECORD] = ConfigRecord(
            {BATTERY_LEVEL: float(battery.level), FEASIBLE: int(battery.can_afford(cost))}
        )
        return reply


def _slot(msg: Message) -> int | None:
    """The server's slot clock, when ``msg`` is one of EdgeFleet's energy-aware messages."""
    if not msg.has_content():
        return None
    for record in msg.content.config_records.values():
        slot = record.get("slot")
        if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0:
            return slot
    return None


def _add_device_id(fields: dict[str, Any], context: Context, status: bool = True) -> None:
    # A bad value stays out; the server then keys the device by its node id (and cannot tell
    # the fleet's partitioning from it). A train reply carries the id only: its metrics are
    # the app's, averaged by the strategy.
    for key in (DEVICE_ID, NUM_PARTITIONS) if status else (DEVICE_ID,):
        if key not in fields and key in context.node_config:
            with contextlib.suppress(TypeError, ValueError):
                fields[key] = int(context.node_config[key])


def _declared_link(context: Context) -> dict[str, float]:
    """The link rate the operator declared for this board (``--node-config link-kbps=512``),
    reported so that a deadline can estimate the device's first round before timing it."""
    value = context.node_config.get(LINK_KBPS)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return {LINK_KBPS: float(value)}
    return {}


def _note_harvest(context: Context, gained: float) -> None:
    # A level read from the board (sysfs) may fall between answers: only gains are harvest.
    if gained > 0:
        held = context.state.config_records.get(HARVEST_KEY, ConfigRecord({"units": 0.0}))
        context.state[HARVEST_KEY] = ConfigRecord({"units": float(held["units"]) + gained})  # type: ignore[arg-type]


def _take_harvest(context: Context) -> float:
    """The energy harvested since the last status answer (and start counting anew)."""
    held = context.state.config_records.get(HARVEST_KEY)
    context.state[HARVEST_KEY] = ConfigRecord({"units": 0.0})
    return 0.0 if held is None else float(held["units"])  # type: ignore[arg-type]


def device_telemetry(battery: Battery, harvested: float) -> dict[str, Any]:
    """What a device reports of itself beside its status: its battery's capacity, the energy
    harvested since its last answer and spent in all, and what the board tells (CPU
    temperature, load, free memory, architecture, accelerator, versions). A reading the
    board does not offer is left out, never sent as a made-up value. The server checks every
    value against its table (:data:`edgefleet.loop.registry.TELEMETRY_FIELDS`)."""
    out: dict[str, Any] = {
        "battery-capacity": float(battery.capacity),
        "harvested": float(harvested),
        ENERGY_SPENT: float(battery.spent_total),
    }
    temp = cpu_temperature()
    if temp is not None:
        out["cpu-temp-c"] = temp
    with contextlib.suppress(OSError, AttributeError):  # no load average on this OS
        out["load-1m"] = round(os.getloadavg()[0], 3)
    free = free_memory_mb()
    if free is not None:
        out["mem-free-mb"] = free
    return {**out, **_platform()}


def cpu_temperature(root: str = "/sys/class/thermal") -> float | None:
    """The CPU's temperature in degrees C from the board's thermal zones (a zone whose type
    names the CPU or SoC first, else the first zone), or None where there is none."""
    zones = sorted(glob.glob(f"{root}/thermal_zone*"))

    def kind(zone: str) -> str:
        try:
            with open(f"{zone}/type") as f:
                return f.read().strip().lower()
        except OSError:
            return ""

    cpu_like = [z for z in zones if any(w in kind(z) for w in ("cpu", "soc", "pkg"))]
    for zone in cpu_like + zones:
        try:
            with open(f"{zone}/temp") as f:
                return int(f.read().strip()) / 1000.0  # millidegrees
        except (OSError, ValueError):
            continue
    return None


def free_memory_mb(meminfo: str = "/proc/meminfo") -> float | None:
    """Memory available to new work (MemAvailable), in MB; None off Linux."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 1024.0, 1)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def _platform() -> dict[str, str]:
    """Architecture, accelerator and versions: fixed for the process, so read once."""
    out = {"arch": platform.machine() or "unknown"}
    try:  # torch only if the app has it: the mod is for any ClientApp
        from edgefleet.task.accelerator import available_accelerators

        out["accelerator"] = available_accelerators()[-1]
    except ImportError:
        pass
    for key, package in (("edgefleet-version", "edgefleet"), ("flwr-version", "flwr")):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[key] = metadata.version(package)
    return out


def load_battery(settings: BatterySettings, context: Context) -> Battery:
    battery = Battery(settings.capacity, settings.source)
    stored = context.state.config_records.get(STATE_KEY)
    if stored is not None:
        battery.load_state_dict(dict(stored))
    return battery


def save_battery(battery: Battery, context: Context) -> None:
    context.state[STATE_KEY] = ConfigRecord(battery.state_dict())  # type: ignore[arg-type]


def status_query(msg: Message, context: Context) -> Message:
    """A query function for a ClientApp that has none: the device is present (it answered),
    and ``energy_mod`` adds the battery. Register it with ``app.query()(status_query)``."""
    fields: dict[str, Any] = {PRESENT: 1}
    _add_device_id(fields, context)
    return Message(RecordDict({STATUS_RECORD: MetricRecord(fields)}), reply_to=msg)
