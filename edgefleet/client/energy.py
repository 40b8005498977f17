"""A device's battery across messages: built from its profile, kept in ``Context.state``.

Flower keeps a node's ``Context.state`` between messages (in simulation and on a
SuperNode), so the battery's level and slot live there as a ConfigRecord; the energy source
is rebuilt from the profile each time, which is exact because arrivals are a function of
(device seed, slot) only.
"""

from __future__ import annotations

import functools

from flwr.app import ConfigRecord, Context

from edgefleet.client.battery import Battery, EnergySource, make_source
from edgefleet.client.device import DeviceProfile
from edgefleet.config import RunConfig
from edgefleet.task.train import seed_for

STATE_KEY = "battery"


@functools.cache  # sources hold no state; a trace file is read once per process, not per message
def energy_source(p: DeviceProfile, cfg: RunConfig) -> EnergySource:
    e = cfg.energy
    if p.energy_source == "bernoulli":
        seed = seed_for(cfg.seed, p.device_id, 0xE4E)
        return make_source("bernoulli", seed=seed, prob=p.harvest_prob, units=e.harvest_units)
    if p.energy_source == "trace":
        return make_source("trace", path=p.trace_path)
    return make_source(p.energy_source)


def load_battery(profile: DeviceProfile, cfg: RunConfig, context: Context) -> Battery:
    battery = Battery(profile.capacity, energy_source(profile, cfg))
    stored = context.state.config_records.get(STATE_KEY)
    if stored is not None:
        battery.load_state_dict(dict(stored))
    return battery


def save_battery(battery: Battery, context: Context) -> None:
    context.state[STATE_KEY] = ConfigRecord(battery.state_dict())  # type: ignore[arg-type]
