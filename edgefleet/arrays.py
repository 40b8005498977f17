"""Flower's ``ArrayRecord`` and plain ``{name: ndarray}`` dicts, one way each.

The pure-math modules (SAGA memory, warm start, reconstruction) and the checkpoint work on
NumPy dicts; messages carry ArrayRecords. Converting in one place keeps the key order and
dtypes the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

State = dict[str, np.ndarray]


def to_numpy(arrays: ArrayRecord) -> State:
    return {k: v.numpy() for k, v in arrays.items()}


def to_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state.items()})
