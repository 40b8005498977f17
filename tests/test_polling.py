"""Polling intervals: the ServerApp's in-memory grid polls for replies every 10 ms
(edgefleet.server.polling); the SuperExecs of EdgeFleet's own fleets poll for tasks as
edgefleet.processes sets them."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.server.polling import fast_grid


@pytest.mark.parametrize(("interval", "expected"), [(0.1, 0.01), (None, None)])
def test_fast_grid(interval: float | None, expected: float | None) -> None:
    class Grid:
        pass

    grid = Grid()
    if interval is not None:
        grid.pull_interval = interval  # type: ignore[attr-defined]
    fast_grid(grid)
    assert getattr(grid, "pull_interval", None) == expected


@pytest.mark.parametrize(
    ("simulation", "user_value", "expected"),
    [(True, None, None), (False, None, "0.1"), (True, "0.5", "0.5"), (False, "0.5", "0.5")],
)
def test_superexec_task_poll_interval(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    simulation: bool,
    user_value: str | None,
    expected: str | None,
) -> None:
    """A deployment fleet's SuperExec polls for tasks every 0.1 s (each run starts within
    0.1 s); the simulation SuperLink's, which launches one task a run, keeps Flower's own
    once a second, which costs its Ray actors nothing to speak of. A value the user set wins."""
    from edgefleet import processes

    if user_value is None:
        monkeypatch.delenv(processes.POLL_VAR, raising=False)
    else:
        monkeypatch.setenv(processes.POLL_VAR, user_value)
    fleet = processes.FlowerFleet(tmp_path)
    started: dict[str, dict[str, str]] = {}

    def start(name, args, *, env=None, **_):
        started[name] = dict(env if env is not None else fleet.env)

    monkeypatch.setattr(fleet, "start", start)
    monkeypatch.setattr(fleet, "write_connection", lambda: None)
    monkeypatch.setattr(fleet, "wait_for_health", lambda proc, timeout: None)
    fleet.start_superlink(simulation=simulation)
    assert started["superlink"].get(processes.POLL_VAR) == expected
    assert started["superlink"][processes.TAG_VAR] == fleet.tag  # the rest is the fleet's
