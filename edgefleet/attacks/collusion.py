"""How colluding devices share their honest updates, so that ALIE and IPM can estimate the
honest mean and spread.

Each colluder trains honestly first, posts its honest update to a board under (run, round,
partition) and takes the estimate from every update on the board for that round so far
(its own included): the coordinate-wise mean and population standard deviation. Nobody
waits for the others (a colluder that blocked would stall the simulation's actor it runs
on), so the first colluder of a round sees only itself: its estimate is its own update with
zero spread (ALIE then sends its honest update unchanged; IPM sends ``-epsilon`` times it).
Updates of another shape (a colluder training a different CA-HFP submodel) are left out.

Two boards:

- :class:`InProcessBoard` (the default): a dict in the Python process. In Flower's
  Simulation Engine each Ray actor is its own process with its own copy, so it sees only the
  colluders that run on the same actor, one after another; with one actor
  (``num-supernodes`` devices on ``client-resources`` that fit one actor) that is all of them.
- :class:`FolderBoard`: one ``.npy`` file per colluder in a folder on the machine's disk
  (written atomically, so a reader sees whole files only), seen by every actor on that
  machine; old rounds are deleted as new ones are posted.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from edgefleet.fileio import atomic_write


class Estimate(NamedTuple):
    mean: np.ndarray
    std: np.ndarray
    n_updates: int  # how many colluders' updates it is made of


def estimate(updates: Sequence[np.ndarray]) -> Estimate:
    """Coordinate-wise mean and population standard deviation (zero for one update)."""
    if not updates:
        raise ValueError("estimate: no updates")
    stack = np.stack([np.asarray(u, dtype=np.float64) for u in updates])
    return Estimate(stack.mean(axis=0), stack.std(axis=0), len(updates))


class Board(Protocol):
    def share(self, run_id: int, server_round: int, who: int, update: np.ndarray) -> Estimate:
        """Post ``who``'s honest ``update`` and return the estimate from every update of
        the same length on the board for (run, round), ``update`` included."""
        ...


class InProcessBoard:
    """A board in this process's memory; keeps only each run's latest round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a ClientApp may run in threads of one process
        self._posts: dict[int, tuple[int, dict[int, np.ndarray]]] = {}

    def share(self, run_id: int, server_round: int, who: int, update: np.ndarray) -> Estimate:
        update = np.asarray(update, dtype=np.float64)
        with self._lock:
            rnd, posts = self._posts.get(run_id, (server_round, {}))
            if rnd != server_round:
                posts = {}
            posts[who] = update
            self._posts[run_id] = (server_round, posts)
            same = [u for u in posts.values() if u.shape == update.shape]
        return estimate(same)


class FolderBoard:
    """A board in ``folder``: ``run-R/round-N/p<who>-<length>.npy``. Give every colluder
    the same folder (a fresh temporary one per benchmark); it must be on the local disk of
    the machine running the simulation."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)

    def share(self, run_id: int, server_round: int, who: int, update: np.ndarray) -> Estimate:
        update = np.asarray(update, dtype=np.float64)
        run = self.folder / f"run-{run_id}"
        here = run / f"round-{server_round}"
        atomic_write(here / f"p{who}-{len(update)}.npy", lambda f: np.save(f, update))
        self._drop_old_rounds(run, server_round)
        same = [update]
        for path in sorted(here.glob(f"p*-{len(update)}.npy")):
            if path.name != f"p{who}-{len(update)}.npy":
                try:
                    same.append(np.load(path))
                except (OSError, ValueError):  # deleted meanwhile by a later round: skip it
                    continue
        return estimate(same)

    @staticmethod
    def _drop_old_rounds(run: Path, server_round: int) -> None:
        # The round before stays: a colluder of that round may still be reading it.
        for old in run.glob("round-*"):
            try:
                rnd = int(old.name.removeprefix("round-"))
            except ValueError:
                continue
            if rnd < server_round - 1:
                shutil.rmtree(old, ignore_errors=True)
