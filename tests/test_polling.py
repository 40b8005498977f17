"""The ServerApp's in-memory grid polls for replies every 10 ms (edgefleet.server.polling)."""

from __future__ import annotations

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
