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
    assert SOURCES == ("bernoulli", "trace", "always-on", "sysfs")
    with pytest.raises(ValueError, match="'solar' is unknown; valid: bernoulli, trace"):
        make_source("solar")
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


def _fake_power_supply(root: Path) -> Path:
    ac = root / "AC"
    ac.mkdir(parents=True)
    (ac / "type").write_text("Mains\n")
    (ac / "online").write_text("1\n")
    bat = root / "BAT0"
    bat.mkdir()
    (bat / "type").write_text("Battery\n")
    (bat / "capacity").write_text("42\n")
    (bat / "status").write_text("Discharging\n")
    return bat


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


def test_sysfs_unavailable(tmp_path: Path) -> None:
    src = SysfsSource(tmp_path / "nothing")
    assert not src.available() and src.read() is None
    with pytest.raises(SourceUnavailableError):
        src.level_fraction()


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
