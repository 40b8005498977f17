"""The ``solar`` energy source: harvest from pvlib's bundled measured irradiance."""

from __future__ import annotations

import numpy as np
import pytest

from edgefleet.client.battery import (
    SOLAR_SITES,
    Battery,
    EnergyConfigError,
    SolarSource,
    bundled_irradiance,
    make_source,
)
from edgefleet.config import ConfigError, parse_run_config

AREA, EFF, UNIT = 0.001, 0.2, 4.0


def test_bundled_years_are_measured_hourly_irradiance() -> None:
    for site in SOLAR_SITES:
        ghi = bundled_irradiance(site)
        assert ghi.shape == (8760,) and np.all(ghi >= 0) and ghi.max() > 500
        # nights are dark: the first hours of 1 January, local time
        assert np.all(ghi[:5] == 0)
    with pytest.raises(EnergyConfigError, match="greensboro, sand-point, miami"):
        bundled_irradiance("berlin")


def test_hourly_slots_harvest_exactly_the_irradiance() -> None:
    ghi = bundled_irradiance("greensboro")
    source = make_source(
        "solar", site="greensboro", panel_area=AREA, efficiency=EFF, slot_seconds=3600.0,
        unit_joules=UNIT,
    )  # fmt: skip
    got = source.arrivals(0, 48)
    np.testing.assert_allclose(got, ghi[:48] * AREA * EFF * 3600 / UNIT, rtol=1e-9, atol=1e-9)
    assert got[:5].sum() == 0 and got.max() > 0  # night, then day
    # Harvest follows the irradiance: more sun, more energy, slot by slot.
    order = np.argsort(ghi[:48], kind="stable")
    assert np.all(np.diff(got[order]) >= -1e-12)
    # the year loops, and a phase of a day shifts the series by 24 slots
    np.testing.assert_allclose(source.arrivals(8760, 8784), got[:24], rtol=1e-9, atol=1e-9)
    shifted = SolarSource(ghi, AREA, EFF, 3600.0, UNIT, phase_hours=24)
    np.testing.assert_allclose(shifted.arrivals(0, 24), got[24:48], rtol=1e-9, atol=1e-9)


def test_short_slots_split_the_hour_and_long_slots_sum_it() -> None:
    ghi = bundled_irradiance("miami")
    per_hour = ghi * AREA * EFF * 3600 / UNIT
    quarter = SolarSource(ghi, AREA, EFF, 900.0, UNIT).arrivals(0, 4 * 24)
    np.testing.assert_allclose(quarter, np.repeat(per_hour[:24] / 4, 4), rtol=1e-9, atol=1e-9)
    day = SolarSource(ghi, AREA, EFF, 86400.0, UNIT).arrivals(0, 3)
    np.testing.assert_allclose(day, per_hour[:72].reshape(3, 24).sum(1), rtol=1e-9)
    # a slot is a point on the clock: advancing slot by slot equals one jump
    a = Battery(10.0, SolarSource(ghi, AREA, EFF, 900.0, UNIT), level=0.0)
    b = Battery(10.0, SolarSource(ghi, AREA, EFF, 900.0, UNIT), level=0.0)
    for slot in range(1, 200):
        a.advance(slot)
    b.advance(199)
    assert a.level == pytest.approx(b.level)


def test_a_battery_charges_by_day_only() -> None:
    ghi = bundled_irradiance("sand-point")
    source = SolarSource(ghi, AREA, EFF, 60.0, UNIT)
    battery = Battery(1e9, source, level=0.0)  # large: nothing lost to a full battery
    night = 5 * 60  # slots of one minute: 05:00 on 1 January, still dark
    battery.advance(night)
    assert battery.level == 0.0
    noon = np.flatnonzero(ghi[:24])[0]  # the first lit hour
    battery.advance((noon + 1) * 60)
    assert battery.level == pytest.approx(ghi[noon] * AREA * EFF * 3600 / UNIT)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(EnergyConfigError, match="efficiency"):
        SolarSource([1.0], AREA, 1.5, 60.0, UNIT)
    with pytest.raises(EnergyConfigError, match="slot_seconds"):
        SolarSource([1.0], AREA, EFF, 0.0, UNIT)
    with pytest.raises(ConfigError, match="energy.panel-efficiency"):
        parse_run_config({"energy.source": "solar", "energy.panel-efficiency": 0.0})
    cfg = parse_run_config({"energy.source": "solar", "selection.mode": "energy-age"})
    assert cfg.energy.source == "solar"


def test_each_device_gets_a_site_and_a_phase() -> None:
    from edgefleet.client.app import energy_source, solar_site
    from edgefleet.client.device import get_profile
    from edgefleet.config import DEFAULTS

    run_config = {**DEFAULTS, "energy.source": "solar", "selection.mode": "energy-age"}
    sources = []
    for partition in range(3):
        cfg, profile = get_profile(run_config, {"partition-id": partition, "num-partitions": 3})
        sources.append(energy_source(profile, cfg))
    assert {solar_site(i) for i in range(3)} == set(SOLAR_SITES)
    week = [s.arrivals(0, 7 * 24 * 60).sum() for s in sources]
    assert len(set(week)) == 3 and all(w > 0 for w in week)
