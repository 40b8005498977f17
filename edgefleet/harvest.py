"""The names of the energy sources a battery can harvest from (``energy.source``).

A leaf module: the server's energy section (:mod:`edgefleet.strategies.energy_selection`)
checks the key against these names without importing the client's battery
(:mod:`edgefleet.client.battery`, where the sources themselves are built).
"""

from __future__ import annotations

from enum import StrEnum


class SourceKind(StrEnum):
    """Where a battery's energy arrivals come from (``energy.source``)."""

    BERNOULLI = "bernoulli"
    TRACE = "trace"
    ALWAYS_ON = "always-on"
    SYSFS = "sysfs"
    SOLAR = "solar"


SOURCES: tuple[str, ...] = tuple(m.value for m in SourceKind)
