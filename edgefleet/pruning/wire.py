"""How kept channels travel in messages: an ArrayRecord ``kept`` of group name -> sorted
int64 channel indices, next to the ``arrays`` of a compact submodel (both directions)."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

KEPT = "kept"


def kept_record(kept: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({g: Array(np.asarray(idx, dtype=np.int64)) for g, idx in kept.items()})


def kept_from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {g: arr.numpy() for g, arr in record.items()}
