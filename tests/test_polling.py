"""Shorter polling in the Simulation Engine's process (edgefleet.server.polling)."""

from __future__ import annotations

import queue
import threading
import time

import flwr.server.superlink.fleet.vce.vce_api as vce
import pytest

from edgefleet.server.polling import (
    FAST_DISPATCH_ENV,
    FLOWER_LOOP_SHA256,
    fast_dispatch,
    fast_grid,
    install_if_asked,
)


class FakeState:
    """Undelivered messages per node; counts the engine's passes over the nodes."""

    def __init__(self, nodes: list[int]) -> None:
        self.pending: dict[int, list[str]] = {n: [] for n in nodes}
        self.calls = 0

    def get_message_ins(self, node_id: int, limit: int) -> list[str]:
        self.calls += 1
        out, self.pending[node_id] = self.pending[node_id][:limit], self.pending[node_id][limit:]
        return out


def test_the_dispatcher_hands_messages_on_within_milliseconds(monkeypatch) -> None:
    monkeypatch.setattr(vce, "add_messages_to_queue", vce.add_messages_to_queue)
    assert fast_dispatch() and fast_dispatch()  # installed once, then found installed
    state, out, stop = FakeState([1, 2, 3]), queue.Queue(), threading.Event()
    loop = threading.Thread(
        target=vce.add_messages_to_queue, args=(state, out, {1: 0, 2: 1, 3: 2}, stop)
    )
    loop.start()
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        state.pending[2].append("m")
        assert out.get(timeout=5) == "m"
        # Flower's own loop waits 100 ms between passes (50 ms on average); this one 5 ms.
        assert time.monotonic() - t0 < 0.05 or state.calls > 3 * 40
    finally:
        stop.set()
        loop.join()


def test_fast_dispatch_leaves_another_flower_alone(monkeypatch) -> None:
    monkeypatch.setattr(vce, "add_messages_to_queue", lambda state, queue: None)
    assert not fast_dispatch()


@pytest.mark.parametrize(("interval", "expected"), [(0.1, 0.01), (None, None)])
def test_fast_grid(interval: float | None, expected: float | None) -> None:
    class Grid:
        pass

    grid = Grid()
    if interval is not None:
        grid.pull_interval = interval  # type: ignore[attr-defined]
    fast_grid(grid)
    assert getattr(grid, "pull_interval", None) == expected


def test_the_replaced_loop_is_flowers_as_checked() -> None:
    """The adaptive dispatcher reproduces Flower 1.42's loop with a shorter pause: when
    Flower's loop changes, this fails, and the replacement must be checked again (or
    dropped)."""
    import hashlib
    import inspect

    from flwr.server.superlink.fleet.vce import vce_api

    source = inspect.getsource(vce_api.add_messages_to_queue)
    assert hashlib.sha256(source.encode()).hexdigest() == FLOWER_LOOP_SHA256, source


def test_the_loop_is_installed_only_where_the_runner_asks(monkeypatch) -> None:
    monkeypatch.delenv(FAST_DISPATCH_ENV, raising=False)
    assert not install_if_asked()
    from edgefleet.simulation.engine import Engine

    engine = Engine()
    assert engine.fleet.env[FAST_DISPATCH_ENV] == "1"
