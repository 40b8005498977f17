"""Shorter reply polling for the ServerApp's grid where the runtime has an in-memory one.

:func:`fast_grid` sets the in-memory grid's own ``pull_interval`` (its public attribute) to
10 ms, so the ServerApp sees a round's replies within 10 ms instead of Flower's default; a
grid without one (the Deployment Engine's, over the network) is left alone.

An earlier replacement of the Simulation Engine's dispatcher loop (Flower's
``vce_api.add_messages_to_queue``, installed in the engine's process) is gone: measured
side by side against Flower's own loop (``benchmarks/results/sim_overhead-100dev-dispatch-
r3-2026-12-04.json``, ``sim_overhead-1000dev-dispatch-r2-2026-12-04.json``), it gained
nothing to show in 4 of 5 repeats at 100 and 1,000 devices, and at 10 devices earlier runs
read within the machine's noise (docs/benchmarks.md).
"""

from __future__ import annotations


def fast_grid(grid: object) -> None:
    """Poll the in-memory grid for replies every 10 ms."""
    if isinstance(getattr(grid, "pull_interval", None), float):
        grid.pull_interval = 0.01  # type: ignore[attr-defined]
