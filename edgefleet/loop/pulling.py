"""Pulling replies so that one slow upload does not hold the others back.

A SuperNode sends its reply in two steps: the message (a small header naming the reply's
objects), then the objects themselves (the model's arrays). Flower's deployment grid
(``HttpGrid``, Flower 1.42) returns a reply from ``pull_messages`` as soon as the header is
there and then, inside the same call, downloads the arrays, retrying until the upload has
finished. On a 512 kbit/s link an 800 KB model takes 12-13 s to arrive, and for all that
time the call, and a loop that polls with it, waits: replies that arrived meanwhile over
fast links are not seen, those devices are not sent a new model, and their arrival is
stamped late (``docs/benchmarks/links.md`` measured fast boards taking 6.5-14.4 s an update
beside one cellular board, against 3.1-5.9 s on an all-fast fleet).

:class:`ReplyPuller` watches each outstanding reply on a thread of its own, which asks for it
every ``poll_s`` until it has fully arrived, and hands the loop the replies that are in: a
slow upload holds one thread. That is one ``pull_messages`` call per outstanding reply and
poll, where Flower's own ``send_and_receive`` makes one call for all of them, a cost that
matters only for fleets of hundreds of devices in flight at once. Grids whose pulls never
wait on an upload (EdgeFleet's in-process grids, whose order must stay a function of the
seed, and Flower's Simulation Engine, whose replies sit in memory whole) are pulled
directly, in the loop's own thread, as before.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterable
from logging import WARNING

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from edgefleet.bounds import bound_reason


def pulls_wait_on_uploads(grid: object) -> bool:
    """Whether ``grid`` (or the grid it wraps) is Flower's deployment grid, whose
    ``pull_messages`` downloads each reply's arrays in the call (module docstring).

    Looked up in ``sys.modules``: a process that never imported Flower's deployment grid
    cannot hold one, and importing it to ask would cost seconds."""
    module = sys.modules.get("flwr.superlink.grid.http_grid")
    http_grid = getattr(module, "HttpGrid", None)
    seen: set[int] = set()
    while grid is not None and id(grid) not in seen:
        seen.add(id(grid))
        if http_grid is not None and isinstance(grid, http_grid):
            return True
        grid = getattr(grid, "_grid", None)  # EdgeFleet's wrappers keep the grid they wrap
    return False


class ReplyPuller:
    """``pull(ids, wait)``: the replies to ``ids`` that are in. In the background
    (``background``) each id is watched on a thread of its own, and ``pull`` waits up to
    ``wait`` seconds for the first reply to come in when none has; otherwise it is
    ``grid.pull_messages(ids)`` itself and does not wait.

    An id left out of a later ``pull`` is no longer watched (its thread ends after its
    current call); a reply its last call found is handed over anyway, and the loop ignores
    replies to messages it no longer waits for. A call that raises is logged once per id
    (bounded) and the id is asked again at the next poll."""

    def __init__(self, grid: Grid, background: bool, poll_s: float) -> None:
        self.grid, self.background, self.poll_s = grid, background, poll_s
        self._ready: queue.SimpleQueue[tuple[str, list[Message]]] = queue.SimpleQueue()
        self._watching: dict[str, threading.Event] = {}  # id -> set to stop its thread

    def pull(self, message_ids: Iterable[str], wait: float = 0.0) -> list[Message]:
        ids = list(message_ids)
        if not self.background:
            return list(self.grid.pull_messages(ids))
        wanted = set(ids)
        for mid in [m for m in self._watching if m not in wanted]:
            self._watching.pop(mid).set()
        for mid in ids:
            if mid not in self._watching:
                stop = self._watching[mid] = threading.Event()
                threading.Thread(
                    target=self._watch, args=(mid, stop), name=f"edgefleet-pull-{mid}", daemon=True
                ).start()
        found: list[tuple[str, list[Message]]] = []
        try:
            found.append(self._ready.get(timeout=wait) if wait > 0 else self._ready.get_nowait())
            while True:
                found.append(self._ready.get_nowait())
        except queue.Empty:
            pass
        out: list[Message] = []
        for mid, replies in found:
            self._watching.pop(mid, None)
            out.extend(replies)
        return out

    def _watch(self, mid: str, stop: threading.Event) -> None:
        told = False
        while not stop.is_set():
            try:
                replies = list(self.grid.pull_messages([mid]))
            except Exception as err:  # noqa: BLE001 - a failed pull is asked again, never fatal
                if not told:
                    log(WARNING, "Pulling the reply to message %s failed (asking again): %s",
                        mid, bound_reason(f"{type(err).__name__}: {err}"))  # fmt: skip
                    told = True
                replies = []
            if replies:
                self._ready.put((mid, replies))
                return
            stop.wait(self.poll_s)

    def close(self) -> None:
        """Stop watching; calls under way finish in their threads, unwaited for."""
        for stop in self._watching.values():
            stop.set()
        self._watching.clear()
