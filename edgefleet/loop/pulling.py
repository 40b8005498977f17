"""Pulling replies so that one slow upload does not hold the others back.

A SuperNode sends its reply in two steps: the message (a small header naming the reply's
objects), then the objects themselves (the model's arrays). Flower's deployment grid
(``HttpGrid``, Flower 1.42) returns a reply from ``pull_messages`` as soon as the header is
there and then, inside the same call, downloads the arrays, retrying until the upload has
finished. On a 512 kbit/s link an 800 KB model takes 12-13 s to arrive, and for all that
time the call, and a loop that polls with it, waits: replies that arrived meanwhile over
fast links are not seen and those devices are not sent a new model
(``docs/benchmarks/links.md`` measured fast boards taking 8-14 s an update beside one
cellular board, against 4-5 s on an all-fast fleet).

:class:`ReplyPuller` asks for each outstanding reply in a call of its own, on a pool of
threads, and hands the loop what has fully arrived, without blocking: a slow upload holds
one thread. Grids whose pulls never wait on an upload (EdgeFleet's in-process grids, whose
order must stay a function of the seed, and Flower's Simulation Engine, whose replies sit in
memory whole) are pulled directly, in the loop's own thread, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from logging import WARNING

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from edgefleet.bounds import bound_reason

# Threads pulling at once (each holds one outstanding reply's call). More outstanding
# replies than this wait their turn for a thread; a loop with fewer uses fewer.
MAX_PULL_THREADS = 32


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
    """``pull(ids)``: the replies to ``ids`` that have arrived, never waiting on one that is
    still uploading (``background``), or ``grid.pull_messages(ids)`` itself (not).

    In the background each outstanding id gets one ``pull_messages([id])`` call at a time;
    a call that finds nothing ends and the next ``pull`` starts another, so a poll costs one
    call per outstanding reply. A reply pulled for an id the loop has since given up on is
    handed over anyway: the loop ignores replies to messages it no longer waits for. A call
    that raises is logged (bounded) and the id is asked again at the next poll."""

    def __init__(self, grid: Grid, background: bool, threads: int = MAX_PULL_THREADS) -> None:
        self.grid, self.background = grid, background
        self._pool: ThreadPoolExecutor | None = None
        self._threads = max(1, min(threads, MAX_PULL_THREADS))
        self._calls: dict[str, Future[list[Message]]] = {}

    def pull(self, message_ids: Iterable[str]) -> list[Message]:
        ids = list(message_ids)
        if not self.background:
            return list(self.grid.pull_messages(ids))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="edgefleet-pull")
        got: list[Message] = []
        answered: set[str] = set()
        for mid, call in list(self._calls.items()):
            if not call.done():
                continue
            del self._calls[mid]
            try:
                replies = call.result()
            except Exception as err:  # noqa: BLE001 - a failed pull is retried, never fatal
                log(WARNING, "Pulling the reply to message %s failed (asked again): %s", mid,
                    bound_reason(f"{type(err).__name__}: {err}"))  # fmt: skip
                continue
            if replies:
                answered.add(mid)
                got.extend(replies)
        for mid in ids:
            if mid not in self._calls and mid not in answered:
                self._calls[mid] = self._pool.submit(self._pull_one, mid)
        return got

    def _pull_one(self, mid: str) -> list[Message]:
        return list(self.grid.pull_messages([mid]))

    def close(self) -> None:
        """Stop starting calls; calls under way finish in their threads, unwaited for."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._calls.clear()
