"""Shorter polling where the runtime is Flower's Simulation Engine (issue 18).

Two loops poll in the Simulation Engine's process, each every 100 ms: the ServerApp's grid
waiting for replies, and the engine's dispatcher, which hands the messages the ServerApp
stored to the Ray actors (``vce_api.add_messages_to_queue``). Each costs about 50 ms per
message exchange on average, one to three exchanges a round, while a round of the default
benchmark takes about 2.5 s.

- :func:`fast_grid` sets the in-memory grid's own ``pull_interval`` (its public attribute) to
  10 ms; a grid without one (the Deployment Engine's, over the network) is left alone.
- :func:`fast_dispatch` replaces the dispatcher loop with the same calls and a pause that
  follows the loop's own cost: 10 times the time one pass took, between 5 ms and Flower's
  100 ms. A pass asks the message store once per node, so with 10 nodes it waits about 5 ms,
  with 1,000 nodes (a pass of tens of ms) it stays at Flower's 100 ms.

Both act only inside the Simulation Engine's process (where Flower has imported ``vce_api``)
and only on the Flower version whose loop they were written against (:data:`FLOWER_LOOP_SHA256`,
checked by tests/test_polling.py); anywhere else they do nothing. ``fast_dispatch`` must run
before the engine starts its dispatcher thread, which it does after ``ray.init`` and the
actor pool, so EdgeFleet's ServerApp module calls :func:`install_if_asked` when it is loaded:
it installs the loop only where ``EDGEFLEET_FAST_DISPATCH=1`` is set, which EdgeFleet's
simulation runner (``edgefleet run``, sweeps, benchmarks) does for the processes it starts.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from typing import Any

_VCE = "flwr.server.superlink.fleet.vce.vce_api"
_SIGNATURE = ("state", "queue", "nodes_mapping", "f_stop")
FAST_DISPATCH_ENV = "EDGEFLEET_FAST_DISPATCH"
# sha256 of inspect.getsource(vce_api.add_messages_to_queue) in flwr 1.42.0: the loop the
# replacement reproduces. tests/test_polling.py fails when Flower's changes.
FLOWER_LOOP_SHA256 = "953f4bd41a931a7779a4a670ab17b633f6e20b08a0128535328674466419777a"


def install_if_asked() -> bool:
    """:func:`fast_dispatch` where the simulation runner asked for it (its environment)."""
    return os.environ.get(FAST_DISPATCH_ENV) == "1" and fast_dispatch()


def fast_grid(grid: object) -> None:
    """Poll the in-memory grid for replies every 10 ms."""
    if isinstance(getattr(grid, "pull_interval", None), float):
        grid.pull_interval = 0.01  # type: ignore[attr-defined]


def fast_dispatch() -> bool:
    """Install the adaptive dispatcher loop; whether it was installed (now or before)."""
    vce = sys.modules.get(_VCE)
    original = getattr(vce, "add_messages_to_queue", None)
    if vce is None or original is None:
        return False
    if getattr(original, "edgefleet", False):
        return True
    if tuple(inspect.signature(original).parameters) != _SIGNATURE:
        return False  # another Flower: leave its loop alone

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: Any) -> None:
        while not f_stop.is_set():
            start = time.monotonic()
            for node_id in nodes_mapping:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(min(0.1, max(0.005, 10 * (time.monotonic() - start))))

    add_messages_to_queue.edgefleet = True  # type: ignore[attr-defined]
    setattr(vce, "add_messages_to_queue", add_messages_to_queue)  # noqa: B010
    return True
