"""Energy-harvesting battery of a device: slot-based harvest-store-use (EH-FedSAG).

The model of "EH-FedSAG: Variance-Reduced Federated Learning with Energy-Aware
Participation in Energy-Harvesting IoT" (arXiv 2606.18758): time runs in slots; in each slot
some energy may arrive and is stored in a battery of finite capacity (what does not fit is
lost); a round costs Omega units of local training plus one unit of transmission, and a
device may start a round only if its battery covers all of it at the start slot.

Energy sources (choose with :func:`make_source`):

- ``bernoulli`` (default): an arrival of ``units`` with probability ``prob`` per slot, the
  paper's model. The arrival of a slot is a hash of (seed, slot), not a draw from a stateful
  RNG, so a device that the server did not contact for many slots catches up exactly when it
  learns the current slot, and advancing slot by slot equals one jump.
- ``trace``: one value per slot from a measured harvest trace (a solar log, say), looped.
- ``always-on``: mains powered; the battery is always full and every round is affordable.
- ``solar``: a small solar panel under a measured year of hourly global horizontal irradiance
  (GHI, W/m^2) from one of the three typical-meteorological-year files that pvlib ships in its
  wheel (so it works offline): Greensboro NC, Sand Point AK, Miami FL (:data:`SOLAR_SITES`). A
  slot of ``slot_seconds`` harvests area x efficiency x the GHI integrated over the slot (the
  hourly values held constant within their hour), in battery units of ``unit_joules``; slot 0
  is the site's local midnight on 1 January plus ``phase_hours``, and the year loops.
- ``sysfs``: a real Linux board's battery under ``/sys/class/power_supply``. It reports a
  *level*, not arrivals: the battery then takes the measured level (scaled to its capacity)
  at each :meth:`Battery.advance`, and only the real hardware knows what arrived.

From a board's reading to battery units (``sysfs``). The kernel's power-supply class
(Documentation/ABI/testing/sysfs-class-power) gives each supply a folder with a ``type``;
the source reads the first folder, in name order, whose ``type`` is ``Battery`` or ``UPS``
(a UPS HAT may register as either; ``Mains`` and ``USB`` are skipped) and whose ``present``
is not ``0`` - or the one folder named by ``name``. Its charge as a fraction f of full, from
the first of these that reads as a finite number:

1. ``capacity`` (percent): f = capacity / 100;
2. ``energy_now / energy_full`` (µWh), then ``energy_now / energy_full_design``;
3. ``charge_now / charge_full`` (µAh), then ``charge_now / charge_full_design``;

clipped to [0, 1] (an aged cell's ``energy_now`` can exceed its last ``energy_full``). The
battery's level is then f x ``capacity`` battery units, the same units as the round cost
(``energy.train-slots`` + 1): with ``capacity = 10`` and a round costing 4 units, a board
takes part while it reads 40 % or more. Spending lowers the level until the next reading
replaces it; the hardware's reading always wins. A file that cannot be read (a driver's
``EIO``/``ENODATA``, a missing file, text that is not a number, not UTF-8, ``nan``/``inf``)
counts as absent and the next rule is tried; ``capacity_level`` (``Low``, ``Normal``, ...)
alone is not enough. With no readable battery the source is unavailable: building it
fails with :class:`EnergyConfigError`, and a battery that stops reading mid-run makes
:meth:`Battery.advance` raise :class:`SourceUnavailableError` (the ClientApp answers that
round with an error, and selection counts the device as unavailable).

Battery state (``level``, ``slot``, ``spent_total``) round-trips through
:meth:`Battery.state_dict` as plain ints and floats, what a Flower ``ConfigRecord`` in
``Context.state`` can hold. The source itself is rebuilt from the device profile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.errors import SettingError
from edgefleet.harvest import SOURCES

# Arrays built for one advance are at most this many slots long, so a device that was away
# for a very long time catches up in bounded memory.
_CHUNK = 1 << 16

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class EnergyConfigError(SettingError):
    """A bad energy-source or battery parameter; the message names it and its value."""


class ClockError(ValueError):
    """The slot clock went backwards."""


class InsufficientEnergyError(RuntimeError):
    """A device was asked to spend more energy than its battery holds."""

    def __init__(self, level: float, cost: float) -> None:
        super().__init__(f"battery holds {level:g} units, the round costs {cost:g}")
        self.level = level
        self.cost = cost


class SourceUnavailableError(RuntimeError):
    """A measuring source (sysfs) has no reading to give."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic, vectorised)."""
    z = x.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def uniform_hash(seed: int, slots: np.ndarray) -> np.ndarray:
    """A number in [0, 1) per slot, a fixed function of (seed, slot).

    The seed is mixed first so that nearby seeds (devices 0, 1, 2, ...) start at unrelated
    points of the splitmix64 sequence rather than at shifted copies of one stream.
    """
    base = splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
    counters = base + (slots.astype(np.uint64) + np.uint64(1)) * _GAMMA
    # The top 53 bits make an exactly representable double in [0, 1).
    return (splitmix64(counters) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _check_range(start_slot: int, end_slot: int) -> None:
    if start_slot < 0 or end_slot < start_slot:
        raise ClockError(f"slot range [{start_slot}, {end_slot}) is not a range of slots >= 0")


class EnergySource:
    """Base of the energy sources. ``arrivals`` is the contract for harvesting sources;
    ``always_full`` and ``reports_level`` mark the two sources that do not harvest."""

    kind: str = ""
    always_full: bool = False
    reports_level: bool = False

    def arrivals(self, start_slot: int, end_slot: int) -> np.ndarray:
        """Energy units arriving in each slot of [start_slot, end_slot), float64."""
        raise NotImplementedError(f"the {self.kind!r} source reports no arrivals")


class BernoulliSource(EnergySource):
    """Per slot an arrival of ``units`` with probability ``prob`` (the paper's P_h)."""

    kind = "bernoulli"

    def __init__(self, seed: int, prob: float, units: float = 1.0) -> None:
        if not 0.0 <= prob <= 1.0:
            raise EnergyConfigError(f"bernoulli source: prob={prob!r} must be in [0, 1]")
        if not (units >= 0.0 and math.isfinite(units)):
            raise EnergyConfigError(f"bernoulli source: units={units!r} must be finite and >= 0")
        self.seed = int(seed)
        self.prob = float(prob)
        self.units = float(units)

    def arrivals(self, start_slot: int, end_slot: int) -> np.ndarray:
        _check_range(start_slot, end_slot)
        u = uniform_hash(self.seed, np.arange(start_slot, end_slot, dtype=np.int64))
        return np.where(u < self.prob, self.units, 0.0)


class TraceSource(EnergySource):
    """One value per slot from a trace; past its end it loops (or gives 0, ``loop=False``)."""

    kind = "trace"

    def __init__(self, values: Sequence[float], loop: bool = True) -> None:
        arr = np.asarray(values, dtype=np.float64).ravel()
        if arr.size == 0:
            raise EnergyConfigError("trace source: values is empty; give one value per slot")
        bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
        if bad.size:
            i = int(bad[0])
            raise EnergyConfigError(
                f"trace source: value {arr[i]!r} at slot {i} must be finite and >= 0"
            )
        self.values = arr
        self.loop = bool(loop)

    @classmethod
    def from_file(cls, path: str | Path, loop: bool = True) -> TraceSource:
        """One number per line; blank lines and ``#`` comments (whole or trailing) ignored."""
        p = Path(path)
        if not p.is_file():
            raise EnergyConfigError(f"trace source: path={str(p)!r} is not a file")
        values: list[float] = []
        for lineno, line in enumerate(p.read_text().splitlines(), start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                values.append(float(text))
            except ValueError:
                raise EnergyConfigError(
                    f"trace source: {p}:{lineno}: {text!r} is not a number"
                ) from None
        if not values:
            raise EnergyConfigError(f"trace source: path={str(p)!r} holds no values")
        return cls(values, loop=loop)

    def arrivals(self, start_slot: int, end_slot: int) -> np.ndarray:
        _check_range(start_slot, end_slot)
        idx = np.arange(start_slot, end_slot, dtype=np.int64)
        n = self.values.size
        if self.loop:
            return self.values[idx % n]
        out = np.zeros(idx.size, dtype=np.float64)
        inside = idx < n
        out[inside] = self.values[idx[inside]]
        return out


# pvlib's bundled typical-meteorological-year files: site name -> (file, reader).
SOLAR_SITES: dict[str, tuple[str, str]] = {
    "greensboro": ("723170TYA.CSV", "tmy3"),
    "sand-point": ("703165TY.csv", "tmy3"),
    "miami": ("12839.tm2", "tmy2"),
}
_HOUR = 3600.0


def bundled_irradiance(site: str) -> np.ndarray:
    """The site's 8760 hourly GHI values (W/m^2, file order) from pvlib's data folder."""
    if site not in SOLAR_SITES:
        raise EnergyConfigError(f"solar source: site {site!r}; valid: {', '.join(SOLAR_SITES)}")
    return _read_site(site).copy()


@functools.cache  # one read per process (pandas parses 8760 rows in ~0.3 s)
def _read_site(site: str) -> np.ndarray:
    try:
        import pvlib
    except ImportError:
        raise EnergyConfigError(
            "energy source 'solar' needs pvlib (pip install 'edgefleet[solar]')"
        ) from None
    name, reader = SOLAR_SITES[site]
    path = Path(pvlib.__file__).parent / "data" / name
    if reader == "tmy3":
        data, _ = pvlib.iotools.read_tmy3(path, map_variables=True)
        ghi = data["ghi"]
    else:
        data, _ = pvlib.iotools.read_tmy2(path)
        ghi = data["GHI"]
    values = np.asarray(ghi, dtype=np.float64)
    values.flags.writeable = False
    return values


class SolarSource(EnergySource):
    """A solar panel under an hourly irradiance series (module docstring, ``solar``)."""

    kind = "solar"

    def __init__(
        self,
        irradiance: Sequence[float] | np.ndarray,
        panel_area: float,
        efficiency: float,
        slot_seconds: float,
        unit_joules: float,
        phase_hours: float = 0.0,
    ) -> None:
        ghi = np.asarray(irradiance, dtype=np.float64).ravel()
        if ghi.size == 0 or not np.all(np.isfinite(ghi)) or np.any(ghi < 0):
            raise EnergyConfigError("solar source: irradiance must be finite values >= 0")
        for name, value in (
            ("panel_area", panel_area),
            ("slot_seconds", slot_seconds),
            ("unit_joules", unit_joules),
        ):
            if not (math.isfinite(value) and value > 0):
                raise EnergyConfigError(f"solar source: {name}={value!r} must be finite and > 0")
        if not 0 < efficiency <= 1:
            raise EnergyConfigError(f"solar source: efficiency={efficiency!r} must be in (0, 1]")
        if not (math.isfinite(phase_hours) and phase_hours >= 0):
            raise EnergyConfigError(f"solar source: phase_hours={phase_hours!r} must be >= 0")
        # J/m^2 received from the series' start to the start of each hour (and the year's end)
        self._cum = np.concatenate([[0.0], np.cumsum(ghi * _HOUR)])
        self._edges = np.arange(ghi.size + 1, dtype=np.float64) * _HOUR
        self.joules_per_unit = float(unit_joules) / (float(panel_area) * float(efficiency))
        self.slot_seconds = float(slot_seconds)
        self.offset = float(phase_hours) * _HOUR

    def _received(self, t: np.ndarray) -> np.ndarray:
        """J/m^2 received from slot 0's start to ``t`` seconds after it, the series looped."""
        year = self._edges[-1]
        t = t + self.offset
        loops = np.floor(t / year)
        return loops * self._cum[-1] + np.interp(t - loops * year, self._edges, self._cum)

    def arrivals(self, start_slot: int, end_slot: int) -> np.ndarray:
        _check_range(start_slot, end_slot)
        edges = np.arange(start_slot, end_slot + 1, dtype=np.float64) * self.slot_seconds
        per_area = np.diff(self._received(edges))
        return np.maximum(per_area, 0.0) / self.joules_per_unit


class AlwaysOn(EnergySource):
    """Mains powered: arrivals are unbounded, so the battery is always full."""

    kind = "always-on"
    always_full = True

    def arrivals(self, start_slot: int, end_slot: int) -> np.ndarray:
        _check_range(start_slot, end_slot)
        return np.full(end_slot - start_slot, np.inf)


@dataclass(frozen=True)
class SysfsReading:
    name: str  # the power_supply entry, e.g. "BAT0"
    fraction: float  # charge level in [0, 1]
    status: str  # "Charging", "Discharging", "Full", "Not charging", "Unknown"


class SysfsSource(EnergySource):
    """The battery of a Linux board under ``/sys/class/power_supply``.

    It reports a *level*, not arrivals: :class:`Battery` with this source sets its level to
    the measured fraction times its capacity at every advance. Which folder and file it
    reads, and how the reading maps to a fraction, is in the module docstring.
    """

    kind = "sysfs"
    reports_level = True

    def __init__(self, path: str | Path = "/sys/class/power_supply", name: str = "") -> None:
        self.path = Path(path)
        self.name = name

    def _entries(self) -> list[Path]:
        if self.name:
            return [self.path / self.name]
        try:
            folders = sorted(self.path.iterdir())
        except OSError:  # no such folder, or not a folder
            return []
        return [
            p for p in folders if _read(p / "type") in BATTERY_TYPES and _read(p / "present") != "0"
        ]

    def read(self) -> SysfsReading | None:
        """The current reading, or None where no battery can be read."""
        for entry in self._entries():
            fraction = _sysfs_fraction(entry)
            if fraction is not None:
                status = _read(entry / "status") or "Unknown"
                return SysfsReading(entry.name, fraction, status)
        return None

    def available(self) -> bool:
        return self.read() is not None

    def level_fraction(self) -> float:
        reading = self.read()
        if reading is None:
            where = self.path / self.name if self.name else self.path
            raise SourceUnavailableError(f"no readable battery under {where}")
        return reading.fraction


# power_supply ``type`` values that hold a charge (the kernel also has Mains, USB, Wireless).
BATTERY_TYPES = ("Battery", "UPS")


def _read(path: Path) -> str | None:
    """A sysfs attribute's text, or None: missing, unreadable (drivers answer EIO or ENODATA
    when the gauge has no value) or not text."""
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_float(path: Path) -> float | None:
    text = _read(path)
    try:
        value = None if text is None else float(text)
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _sysfs_fraction(entry: Path) -> float | None:
    """The charge of one power_supply folder as a fraction in [0, 1] (rules: module docstring)."""
    pct = _read_float(entry / "capacity")
    if pct is not None:
        return min(1.0, max(0.0, pct / 100.0))
    for quantity in ("energy", "charge"):
        now = _read_float(entry / f"{quantity}_now")
        if now is None:
            continue
        for full_name in (f"{quantity}_full", f"{quantity}_full_design"):
            full = _read_float(entry / full_name)
            if full is not None and full > 0:
                return min(1.0, max(0.0, now / full))
    return None


def make_source(kind: str, **params: Any) -> EnergySource:
    """Build an energy source by name (one of :data:`SOURCES`).

    ``bernoulli``: seed, prob, units; ``trace``: values or path, loop; ``always-on``: none;
    ``sysfs``: path, name (and a battery must be readable there); ``solar``: site,
    panel_area, efficiency, slot_seconds, unit_joules, phase_hours.
    """
    builders: dict[str, Any] = {
        "bernoulli": BernoulliSource,
        "trace": _make_trace,
        "always-on": AlwaysOn,
        "sysfs": _make_sysfs,
        "solar": _make_solar,
    }
    if kind not in builders:
        raise EnergyConfigError(f"energy source {kind!r} is unknown; valid: {', '.join(SOURCES)}")
    try:
        source: EnergySource = builders[kind](**params)
    except TypeError as err:
        raise EnergyConfigError(f"energy source {kind!r}: bad parameters {params}: {err}") from None
    return source


def _make_trace(
    values: Sequence[float] | None = None, path: str | Path | None = None, loop: bool = True
) -> TraceSource:
    if (values is None) == (path is None):
        raise EnergyConfigError("trace source: give exactly one of values= or path=")
    if path is not None:
        return TraceSource.from_file(path, loop=loop)
    assert values is not None
    return TraceSource(values, loop=loop)


def _make_solar(site: str, **params: Any) -> SolarSource:
    return SolarSource(bundled_irradiance(site), **params)


def _make_sysfs(path: str | Path = "/sys/class/power_supply", name: str = "") -> SysfsSource:
    source = SysfsSource(path, name)
    if not source.available():
        raise EnergyConfigError(
            f"sysfs source: path={str(path)!r} (name={name!r}) has no readable battery "
            f"(found: {_describe_supplies(Path(path))}); a battery needs type Battery or UPS "
            "and a readable capacity, energy_now or charge_now; valid sources elsewhere: "
            f"{', '.join(s for s in SOURCES if s != 'sysfs')}"
        )
    return source


def _describe_supplies(path: Path) -> str:
    """``"AC (Mains), BAT0 (Battery)"``: what a power_supply folder holds, for an error."""
    try:
        folders = sorted(path.iterdir())
    except OSError:
        return "no such folder"
    return ", ".join(f"{p.name} ({_read(p / 'type') or 'no type'})" for p in folders) or "nothing"


class Battery:
    """Slot-based harvest-store-use battery.

    ``slot`` is the next slot not yet harvested; :meth:`advance` harvests the slots up to the
    server's current slot with clipping at ``capacity`` in every slot, as a real battery
    does. Arrivals are non-negative, so per-slot clipping equals one clip of the running sum
    at the first slot that fills the battery; the sum is taken in slot order, which keeps
    slot-by-slot and one-jump advances bit-identical.

    ``level`` defaults to full. The paper's text available to us did not say; full is what a
    freshly installed (or charged-before-deployment) device has, and an empty start would
    only add about (Omega + 1) / P_h idle slots before the first round that nothing measures.
    Pass ``level=0.0`` to start empty.
    """

    def __init__(
        self,
        capacity: float,
        source: EnergySource,
        level: float | None = None,
        slot: int = 0,
    ) -> None:
        if not (capacity > 0 and math.isfinite(capacity)):
            raise EnergyConfigError(f"battery: capacity={capacity!r} must be finite and > 0")
        start = capacity if level is None else float(level)
        if not 0.0 <= start <= capacity:
            raise EnergyConfigError(f"battery: level={level!r} must be in [0, {capacity}]")
        if slot < 0:
            raise EnergyConfigError(f"battery: slot={slot!r} must be >= 0")
        self.capacity = float(capacity)
        self.source = source
        self.level = float(capacity) if source.always_full else start
        self.slot = int(slot)
        self.spent_total = 0.0

    def advance(self, to_slot: int) -> float:
        """Harvest the slots [slot, to_slot); returns the level."""
        if to_slot < self.slot:
            raise ClockError(
                f"battery: advance to slot {to_slot} but slot {self.slot} already harvested "
                "(the clock went backwards)"
            )
        if self.source.always_full:
            self.level = self.capacity
        elif self.source.reports_level:
            assert isinstance(self.source, SysfsSource)
            self.level = self.source.level_fraction() * self.capacity
        else:
            start = self.slot
            while start < to_slot and self.level < self.capacity:
                end = min(to_slot, start + _CHUNK)
                a = self.source.arrivals(start, end)
                # np.add.accumulate adds in slot order, like the slot-by-slot loop would.
                running = np.add.accumulate(np.concatenate(([self.level], a)))
                self.level = min(self.capacity, float(running[-1]))
                start = end
        self.slot = int(to_slot)
        return self.level

    @staticmethod
    def round_cost(train_slots: int) -> float:
        """Omega units of local training plus one unit of transmission."""
        if train_slots < 0:
            raise EnergyConfigError(f"train_slots={train_slots!r} must be >= 0")
        return float(train_slots) + 1.0

    def can_afford(self, cost: float) -> bool:
        """Exactly enough is enough."""
        return self.source.always_full or self.level >= cost

    def spend(self, cost: float) -> None:
        """Use ``cost`` units; raises (spending nothing) when the battery cannot cover it."""
        if cost < 0:
            raise EnergyConfigError(f"battery: cost={cost!r} must be >= 0")
        if not self.can_afford(cost):
            raise InsufficientEnergyError(self.level, cost)
        self.spent_total += float(cost)
        if not self.source.always_full:
            self.level -= float(cost)

    def state_dict(self) -> dict[str, float | int | str]:
        return {
            "level": self.level,
            "slot": self.slot,
            "spent_total": self.spent_total,
            "capacity": self.capacity,
            "source": self.source.kind,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore level, slot and energy spent. The capacity and source come from the
        device profile; a stored level above a (since lowered) capacity is clipped to it."""
        try:
            level, slot = float(state["level"]), int(state["slot"])
            spent = float(state.get("spent_total", 0.0))
        except (KeyError, TypeError, ValueError) as err:
            raise EnergyConfigError(f"battery state {state!r} is malformed: {err}") from None
        if not (level >= 0.0 and math.isfinite(level)) or slot < 0:
            raise EnergyConfigError(f"battery state level={level!r}, slot={slot!r} out of range")
        self.level = self.capacity if self.source.always_full else min(level, self.capacity)
        self.slot = slot
        self.spent_total = spent
