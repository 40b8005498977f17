"""Server checkpoints: everything a killed run needs to go on from its last finished round.

After every round (that is, before the next one is dispatched) the :class:`Checkpointer`
callback writes ``checkpoint.pkl`` in the run folder: the global model, the number of the
last finished round and the state of every stateful strategy (selection ages and RNG, SAGA
memory, stopping counters, sessions) through their ``state_dict``, plus Python's global
RNG, which Flower's node sampling draws from. The file is written to a temporary name,
fsynced and moved into place, so a crash mid-write leaves the previous checkpoint whole.

Pickle is used because the states hold NumPy arrays next to plain Python values; the file
is the server's own, read back only by the server that wrote it (never load a checkpoint
from an untrusted source).
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from edgefleet.arrays import to_numpy, to_record
from edgefleet.fileio import atomic_write
from edgefleet.strategies.hooks import hooks_of
from edgefleet.strategies.loop import RoundCallback, RoundResult

FILENAME = "checkpoint.pkl"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


@dataclass
class Checkpoint:
    round: int  # the last finished round; the resumed run starts at round + 1
    arrays: dict[str, np.ndarray]  # the global model after that round
    strategy: dict[str, Any]  # strategy.state_dict()
    py_random: Any  # random.getstate()
    extra: dict[str, Any] = field(default_factory=dict)

    def array_record(self) -> ArrayRecord:
        return to_record(self.arrays)


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    data = {"format": FORMAT, "checkpoint": ckpt}
    atomic_write(path, lambda f: pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL))


def load_checkpoint(path: Path) -> Checkpoint:
    try:
        with path.open("rb") as f:
            data = pickle.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
        raise CheckpointError(f"checkpoint {path} is unreadable ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is not an EdgeFleet checkpoint of format {FORMAT}"
        )
    ckpt = data["checkpoint"]
    if not isinstance(ckpt, Checkpoint):
        raise CheckpointError(f"checkpoint {path} holds {type(ckpt).__name__}, not a Checkpoint")
    return ckpt


class Checkpointer(RoundCallback):
    """Round callback (put it last): write the checkpoint once the round is recorded."""

    def __init__(self, run_dir: Path, strategy: Any) -> None:
        self.path = run_dir / FILENAME
        self.strategy = strategy

    def after_round(self, result: RoundResult) -> str | None:
        state = hooks_of(self.strategy).state_dict()
        ckpt = Checkpoint(result.round, to_numpy(result.arrays), state, random.getstate())
        save_checkpoint(self.path, ckpt)
        return None


def resume_from(run_dir: Path, strategy: Any, keys: list[str]) -> Checkpoint | None:
    """Load ``run_dir``'s checkpoint into ``strategy`` and Python's RNG; None if there is none.

    ``keys`` are the model's array names: a checkpoint of another model is refused rather
    than half-loaded.
    """
    path = run_dir / FILENAME
    if not path.exists():
        return None
    ckpt = load_checkpoint(path)
    if set(ckpt.arrays) != set(keys):
        raise CheckpointError(
            f"checkpoint {path} is of another model: its arrays are "
            f"{sorted(ckpt.arrays)[:4]}..., this run's are {sorted(keys)[:4]}..."
        )
    hooks_of(strategy).load_state_dict(ckpt.strategy)
    random.setstate(ckpt.py_random)
    log(INFO, "Resuming from %s: round %d done", path, ckpt.round)
    return ckpt
