"""Energy-harvesting battery and energy sources (EH-FedSAG, arXiv 2606.18758)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgefleet.client.battery import (
    SOURCES,
    AlwaysOn,
    Battery,
    BernoulliSource,
    ClockError,
    EnergyConfigError,
    InsufficientEnergyError,
    SourceUnavailableError,
    SysfsSource,
    TraceSource,
    make_source,
    splitmix64,
)

# --- sources ---------------------------------------------------------------------------


def test_splitmix64_reference_values() -> None:
    # The first outputs of the reference splitmix64 generator seeded with 0: the finaliser
    # applied to 1 x, 2 x, 3 x the golden gamma (Vigna's splitmix64.c).
    gamma = 0x9E3779B97F4A7C15
    states = np.array([(k * gamma) % 2**64 for k in (1, 2, 3)], dtype=np.uint64)
    assert [int(z) for z in splitmix64(states)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


def test_bernoulli_arrivals_are_a_function_of_seed_and_slot() -> None:
    src = BernoulliSource(seed=7, prob=0.3, units=2.0)
    whole = src.arrivals(0, 1000)
    assert whole.dtype == np.float64
    assert set(np.unique(whole)) <= {0.0, 2.0}
    # any window of the same slots gives the same values, whatever was asked before
    np.testing.assert_array_equal(src.arrivals(400, 600), whole[400:600])
    np.testing.assert_array_equal(BernoulliSource(7, 0.3, 2.0).arrivals(0, 1000), whole)
    other = BernoulliSource(seed=8, prob=0.3, units=2.0).arrivals(0, 1000)
    assert not np.array_equal(other, whole)


def test_bernoulli_rate_close_to_prob() -> None:
    for prob in (0.05, 0.3, 0.9):
        a = BernoulliSource(seed=1, prob=prob).arrivals(0, 100_000)
        # 4 standard deviations of the mean of 100k Bernoulli draws
        assert abs(a.mean() - prob) < 4 * np.sqrt(prob * (1 - prob) / 100_000)
    assert BernoulliSource(1, 0.0).arrivals(0, 1000).sum() == 0
    assert BernoulliSource(1, 1.0).arrivals(0, 1000).sum() == 1000


def test_bernoulli_neighbouring_seeds_are_uncorrelated() -> None:
    a = BernoulliSource(0, 0.5).arrivals(0, 20_000)
    b = BernoulliSource(1, 0.5).arrivals(0, 20_000)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
    # nor a shifted copy of each other
    assert abs(np.corrcoef(a[1:], b[:-1])[0, 1]) < 0.05


def test_trace_loops_or_stops() -> None:
    src = TraceSource([1.0, 0.0, 2.5])
    np.testing.assert_array_equal(src.arrivals(0, 7), [1, 0, 2.5, 1, 0, 2.5, 1])
    np.testing.assert_array_equal(src.arrivals(4, 6), [0, 2.5])
    once = TraceSource([1.0, 0.0, 2.5], loop=False)
    np.testing.assert_array_equal(once.arrivals(1, 6), [0, 2.5, 0, 0, 0])


def test_trace_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "solar.txt"
    f.write_text("# harvested units per slot\n1\n\n  0.5  # noon\n#  skipped\n0\n")
    src = TraceSource.from_file(f)
    np.testing.assert_array_equal(src.values, [1.0, 0.5, 0.0])
    np.testing.assert_array_equal(src.arrivals(0, 5), [1.0, 0.5, 0.0, 1.0, 0.5])
    via_factory = make_source("trace", path=str(f), loop=False)
    np.testing.assert_array_equal(via_factory.arrivals(2, 5), [0.0, 0.0, 0.0])


def test_trace_file_errors(tmp_path: Path) -> None:
    with pytest.raises(EnergyConfigError, match="is not a file"):
        TraceSource.from_file(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(EnergyConfigError, match="holds no values"):
        TraceSource.from_file(empty)
    bad = tmp_path / "bad.txt"
    bad.write_text("1\nsunny\n")
    with pytest.raises(EnergyConfigError, match=r"bad.txt:2: 'sunny'"):
        TraceSource.from_file(bad)


def test_always_on() -> None:
    assert np.all(np.isinf(AlwaysOn().arrivals(3, 6)))
    b = Battery(5.0, AlwaysOn(), level=0.0)
    assert b.level == 5.0
    assert b.can_afford(1e9)
    b.spend(100.0)
    assert b.level == 5.0 and b.spent_total == 100.0
    b.advance(10)
    assert b.level == 5.0


def test_make_source_kinds_and_bad_parameters(tmp_path: Path) -> None:
    assert isinstance(make_source("bernoulli", seed=1, prob=0.5), BernoulliSource)
    assert isinstance(make_source("trace", values=[1, 2]), TraceSource)
    assert isinstance(make_source("always-on"), AlwaysOn)
    assert SOURCES == ("bernoulli", "trace", "always-on", "sysfs", "solar")
    with pytest.raises(ValueError, match="'wind' is unknown; valid: bernoulli, trace"):
        make_source("wind")
    with pytest.raises(ValueError, match="prob=1.5"):
        make_source("bernoulli", seed=1, prob=1.5)
    with pytest.raises(ValueError, match="prob=-0.1"):
        make_source("bernoulli", seed=1, prob=-0.1)
    with pytest.raises(ValueError, match="units=-1"):
        make_source("bernoulli", seed=1, prob=0.5, units=-1.0)
    with pytest.raises(ValueError, match="bad parameters"):
        make_source("bernoulli", prob=0.5)  # no seed
    with pytest.raises(ValueError, match="bad parameters"):
        make_source("always-on", prob=0.5)
    with pytest.raises(ValueError, match="values is empty"):
        make_source("trace", values=[])
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        make_source("trace", values=[1.0, -2.0])
    with pytest.raises(ValueError, match="exactly one of"):
        make_source("trace")
    with pytest.raises(ValueError, match="is not a file"):
        make_source("trace", path=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="no readable battery"):
        make_source("sysfs", path=str(tmp_path))


def _supply(root: Path, name: str, kind: str = "Battery", **attrs: str | bytes) -> Path:
    """A fake ``/sys/class/power_supply/<name>`` folder: ``type`` and the given attributes
    (text as sysfs prints it, with a trailing newline)."""
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "type").write_text(f"{kind}\n")
    for key, value in attrs.items():
        path = entry / key
        if isinstance(value, bytes):
            path.write_bytes(value)
        else:
            path.write_text(f"{value}\n")
    return entry


def _fake_power_supply(root: Path) -> Path:
    _supply(root, "AC", "Mains", online="1")
    return _supply(root, "BAT0", capacity="42", status="Discharging")


def _unreadable(path: Path) -> None:
    """Make ``path`` answer reads with EIO, as a fuel-gauge driver does when it has no value
    (root reads files whatever their mode, so permissions cannot fake this)."""
    path.unlink(missing_ok=True)
    path.symlink_to("/proc/self/mem")  # reading it from offset 0 fails with EIO


def test_sysfs_reads_level(tmp_path: Path) -> None:
    bat = _fake_power_supply(tmp_path)
    src = make_source("sysfs", path=str(tmp_path))
    assert isinstance(src, SysfsSource) and src.available()
    reading = src.read()
    assert reading is not None
    assert (reading.name, reading.fraction, reading.status) == ("BAT0", 0.42, "Discharging")
    b = Battery(10.0, src, level=0.0)
    assert b.advance(5) == pytest.approx(4.2)
    (bat / "capacity").write_text("100\n")
    assert b.advance(6) == pytest.approx(10.0)
    # a driver without "capacity": energy_now / energy_full
    (bat / "capacity").unlink()
    (bat / "energy_now").write_text("30000\n")
    (bat / "energy_full").write_text("40000\n")
    assert b.advance(7) == pytest.approx(7.5)
    with pytest.raises(NotImplementedError, match="reports no arrivals"):
        src.arrivals(0, 1)


@pytest.mark.parametrize(
    ("attrs", "fraction"),
    [
        ({"capacity": "42"}, 0.42),
        ({"capacity": "0"}, 0.0),
        ({"capacity": "100"}, 1.0),
        ({"capacity": "104"}, 1.0),  # some gauges overshoot while charging
        ({"capacity": "-3"}, 0.0),
        # µWh: energy_full, else the design value
        ({"energy_now": "30000000", "energy_full": "40000000"}, 0.75),
        ({"energy_now": "30000000", "energy_full_design": "60000000"}, 0.5),
        ({"energy_now": "45000000", "energy_full": "40000000"}, 1.0),  # aged cell
        ({"energy_now": "1", "energy_full": "0", "energy_full_design": "4"}, 0.25),
        # µAh
        ({"charge_now": "1500000", "charge_full": "2000000"}, 0.75),
        ({"charge_now": "500000", "charge_full_design": "2000000"}, 0.25),
        # capacity wins over energy/charge when both are there
        ({"capacity": "10", "energy_now": "3", "energy_full": "4"}, 0.1),
        # energy before charge
        ({"energy_now": "1", "energy_full": "4", "charge_now": "3", "charge_full": "4"}, 0.25),
        # not-a-number capacity: fall back to the next rule
        ({"capacity": "N/A", "charge_now": "1", "charge_full": "2"}, 0.5),
        ({"capacity": "nan", "charge_now": "1", "charge_full": "2"}, 0.5),
        ({"capacity": "inf", "charge_now": "1", "charge_full": "4"}, 0.25),
        ({"capacity": b"\xff\xfe", "charge_now": "1", "charge_full": "4"}, 0.25),
        ({"capacity": "", "charge_now": "3", "charge_full": "4"}, 0.75),
        ({"energy_now": "3", "charge_now": "1", "charge_full": "2"}, 0.5),  # no energy_full
    ],
)
def test_sysfs_fraction_rules(tmp_path: Path, attrs: dict[str, str], fraction: float) -> None:
    _supply(tmp_path, "BAT0", **attrs)
    reading = SysfsSource(tmp_path).read()
    assert reading is not None
    assert reading.fraction == pytest.approx(fraction)
    assert reading.status == "Unknown"  # no status file
    # battery units: the fraction of the device's capacity
    assert Battery(8.0, SysfsSource(tmp_path), level=0.0).advance(1) == pytest.approx(8 * fraction)


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"capacity": "N/A"},
        {"capacity": "nan"},
        {"capacity_level": "Normal"},  # a level word alone is not a fraction
        {"energy_now": "3"},
        {"energy_now": "3", "energy_full": "0"},
        {"charge_now": "3", "charge_full": "-1"},
        {"charge_full": "4"},
    ],
)
def test_sysfs_battery_without_a_reading_is_unavailable(
    tmp_path: Path, attrs: dict[str, str]
) -> None:
    _supply(tmp_path, "BAT0", status="Charging", **attrs)
    src = SysfsSource(tmp_path)
    assert src.read() is None and not src.available()
    with pytest.raises(SourceUnavailableError, match="no readable battery"):
        src.level_fraction()
    with pytest.raises(EnergyConfigError, match=r"found: BAT0 \(Battery\)"):
        make_source("sysfs", path=str(tmp_path))


def test_sysfs_unreadable_file_falls_back(tmp_path: Path) -> None:
    bat = _supply(tmp_path, "BAT0", capacity="42", charge_now="1", charge_full="4")
    _unreadable(bat / "capacity")
    with pytest.raises(OSError):
        (bat / "capacity").read_text()
    assert SysfsSource(tmp_path).level_fraction() == pytest.approx(0.25)
    _unreadable(bat / "charge_now")
    assert not SysfsSource(tmp_path).available()
    # an attribute that is a folder (not a file) is no reading either
    (bat / "charge_now").unlink()
    (bat / "charge_now").mkdir()
    assert SysfsSource(tmp_path).read() is None


def test_sysfs_chooses_the_battery(tmp_path: Path) -> None:
    _supply(tmp_path, "AC", "Mains", online="1", capacity="99")  # not a battery
    _supply(tmp_path, "usb", "USB", online="1", capacity="98")
    _supply(tmp_path, "BAT0", present="0", capacity="0")  # an empty bay
    _supply(tmp_path, "BAT1", capacity="N/A")  # no reading: the next one
    _supply(tmp_path, "BAT2", capacity="61", status="Charging")
    _supply(tmp_path, "BAT3", capacity="5")
    reading = SysfsSource(tmp_path).read()
    assert reading is not None
    assert (reading.name, reading.fraction, reading.status) == ("BAT2", 0.61, "Charging")
    # a named entry is read whatever its type, and only it
    named = SysfsSource(tmp_path, name="BAT3").read()
    assert named is not None and (named.name, named.fraction) == ("BAT3", 0.05)
    assert SysfsSource(tmp_path, name="AC").level_fraction() == pytest.approx(0.99)
    with pytest.raises(SourceUnavailableError, match="BAT9"):
        SysfsSource(tmp_path, name="BAT9").level_fraction()


def test_sysfs_ups_hat(tmp_path: Path) -> None:
    # A UPS HAT driver may register its cells as type UPS (POWER_SUPPLY_TYPE_UPS).
    _supply(tmp_path, "AC", "Mains", online="0")
    _supply(tmp_path, "ups", "UPS", capacity="73", status="Discharging")
    reading = SysfsSource(tmp_path).read()
    assert reading is not None and (reading.name, reading.fraction) == ("ups", 0.73)


def test_sysfs_mains_only_board(tmp_path: Path) -> None:
    # A Pi on a plain power supply: only the firmware's mains/USB entries.
    _supply(tmp_path, "rpi-usb", "USB", online="1")
    with pytest.raises(EnergyConfigError, match=r"found: rpi-usb \(USB\).*always-on"):
        make_source("sysfs", path=str(tmp_path))
    with pytest.raises(EnergyConfigError, match="found: no such folder"):
        make_source("sysfs", path=str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EnergyConfigError, match="found: nothing"):
        make_source("sysfs", path=str(tmp_path / "empty"))


def test_sysfs_battery_follows_the_hardware(tmp_path: Path) -> None:
    # Spending lowers the level until the next reading; the reading always wins, and a
    # battery that stops reading mid-run raises at the next advance.
    bat = _supply(tmp_path, "BAT0", capacity="50")
    b = Battery(10.0, make_source("sysfs", path=str(tmp_path)))
    cost = Battery.round_cost(train_slots=3)
    assert b.advance(1) == pytest.approx(5.0) and b.can_afford(cost)
    b.spend(cost)
    assert b.level == pytest.approx(1.0) and not b.can_afford(cost)
    assert b.advance(2) == pytest.approx(5.0)  # the gauge has not moved yet
    (bat / "capacity").write_text("39\n")
    assert b.advance(3) == pytest.approx(3.9) and not b.can_afford(cost)
    (bat / "capacity").write_text("40\n")
    assert b.advance(4) == pytest.approx(4.0) and b.can_afford(cost)  # exactly enough
    restored = Battery(10.0, SysfsSource(tmp_path))
    restored.load_state_dict(b.state_dict())
    assert restored.advance(5) == pytest.approx(4.0)
    _unreadable(bat / "capacity")
    with pytest.raises(SourceUnavailableError, match="no readable battery"):
        b.advance(6)
    assert b.slot == 4  # nothing advanced


def test_sysfs_unavailable(tmp_path: Path) -> None:
    src = SysfsSource(tmp_path / "nothing")
    assert not src.available() and src.read() is None
    with pytest.raises(SourceUnavailableError):
        src.level_fraction()
    (tmp_path / "file").write_text("x")
    assert SysfsSource(tmp_path / "file").read() is None  # a path that is not a folder


# --- battery ---------------------------------------------------------------------------


def test_advance_slot_by_slot_equals_one_jump() -> None:
    # units that are not binary fractions, so a different summation order would show
    for seed in range(5):
        src = BernoulliSource(seed=seed, prob=0.2, units=0.3)
        jump = Battery(50.0, src, level=0.0)
        step = Battery(50.0, src, level=0.0)
        jump.advance(400)
        for s in range(1, 401):
            step.advance(s)
        assert jump.level == step.level
        assert jump.slot == step.slot == 400
        # uneven pieces, too
        pieces = Battery(50.0, src, level=0.0)
        for s in (3, 3, 17, 200, 399, 400):
            pieces.advance(s)
        assert pieces.level == jump.level


def test_catch_up_after_spending_matches_reference_loop() -> None:
    # A device contacted at a few slots, spending a round whenever it can, against a
    # slot-by-slot loop of the same arrivals: clip every slot, spend at the same slots.
    src = BernoulliSource(seed=3, prob=0.4)
    contacts = (50, 51, 120, 300)
    b = Battery(6.0, src, level=0.0)
    for stop in contacts:
        b.advance(stop)
        if b.can_afford(4.0):
            b.spend(4.0)
    arrivals = src.arrivals(0, 300)
    ref = 0.0
    for s in range(300):
        ref = min(6.0, ref + arrivals[s])
        if s + 1 in contacts and ref >= 4.0:
            ref -= 4.0
    assert b.level == ref
    assert b.spent_total > 0


def test_capacity_clipping_per_slot() -> None:
    # trace: 3 units, then nothing; capacity 2: the overflow of slot 0 is lost
    b = Battery(2.0, TraceSource([3.0, 0.0, 0.0, 1.0], loop=False), level=0.0)
    assert b.advance(1) == 2.0
    b.spend(2.0)
    assert b.advance(3) == 0.0
    assert b.advance(4) == 1.0
    full = Battery(4.0, BernoulliSource(0, 1.0))
    assert full.level == 4.0  # default: starts full
    assert full.advance(1000) == 4.0


def test_feasibility_boundary_and_declining_spends_nothing() -> None:
    cost = Battery.round_cost(train_slots=3)
    assert cost == 4.0
    b = Battery(10.0, TraceSource([0.0]), level=4.0)
    assert b.can_afford(cost)  # exactly enough is enough
    b.level = 3.0
    assert not b.can_afford(cost)  # one unit short
    with pytest.raises(InsufficientEnergyError, match="holds 3 units, the round costs 4"):
        b.spend(cost)
    assert b.level == 3.0 and b.spent_total == 0.0
    b.level = 4.0
    b.spend(cost)
    assert b.level == 0.0 and b.spent_total == 4.0


def test_clock_and_parameter_errors() -> None:
    b = Battery(5.0, BernoulliSource(0, 0.5))
    b.advance(10)
    b.advance(10)  # same slot: nothing to harvest, fine
    with pytest.raises(ClockError, match="went backwards"):
        b.advance(9)
    with pytest.raises(ValueError, match="capacity=0"):
        Battery(0.0, AlwaysOn())
    with pytest.raises(ValueError, match="level=6"):
        Battery(5.0, AlwaysOn(), level=6.0)
    with pytest.raises(ValueError, match="train_slots=-1"):
        Battery.round_cost(-1)
    with pytest.raises(ValueError, match="cost=-1"):
        b.spend(-1.0)
    with pytest.raises(ClockError):
        BernoulliSource(0, 0.5).arrivals(5, 4)


def test_state_round_trip_plain_types() -> None:
    src = BernoulliSource(seed=11, prob=0.25)
    a = Battery(8.0, src, level=1.0)
    a.advance(37)
    if a.can_afford(2.0):
        a.spend(2.0)
    state = a.state_dict()
    assert all(type(v) in (int, float, str) for v in state.values())
    b = Battery(8.0, src)
    b.load_state_dict(state)
    assert (b.level, b.slot, b.spent_total) == (a.level, a.slot, a.spent_total)
    assert a.advance(500) == b.advance(500)
    # a capacity lowered since the checkpoint clips the stored level
    small = Battery(0.5, src)
    small.load_state_dict({"level": 3.0, "slot": 2})
    assert small.level == 0.5
    with pytest.raises(ValueError, match="malformed"):
        b.load_state_dict({"slot": 3})
    with pytest.raises(ValueError, match="out of range"):
        b.load_state_dict({"level": -1.0, "slot": 3})
