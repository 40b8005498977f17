"""Deliberately bad train replies, for testing the server's screening (never in production).

A SuperNode started with ``--node-config 'test-corrupt=KIND ...'`` trains honestly and then
spoils its reply in one way; ``cycle`` takes a different way every round. The server must
drop each such reply with its reason and finish the run with the honest devices.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from edgefleet.pruning.wire import KEPT

KINDS: tuple[str, ...] = ("nan", "shape", "missing-key", "indices", "huge", "dtype")
NODE_CONFIG_KEY = "test-corrupt"
HUGE_BYTES = 64 * 2**20  # big enough to hurt a server that trusts sizes, small enough for gRPC


def corrupt(content: RecordDict, kind: str, server_round: int) -> RecordDict:
    """``content`` (a train reply) spoiled as ``kind`` says."""
    if kind == "cycle":
        kind = KINDS[(server_round - 1) % len(KINDS)]
    if kind not in KINDS:
        raise ValueError(
            f"node config {NODE_CONFIG_KEY}={kind!r}; valid choices: cycle, {', '.join(KINDS)}"
        )
    arrays = {k: v.numpy() for k, v in content.array_records["arrays"].items()}
    first = next(iter(arrays))
    if kind == "nan":
        arrays[first] = np.full_like(arrays[first], np.nan)
    elif kind == "shape":
        arrays[first] = arrays[first].reshape(-1)[:-1].copy()
    elif kind == "missing-key":
        del arrays[first]
    elif kind == "dtype":
        arrays[first] = arrays[first].astype(np.float64)
    elif kind == "huge":
        arrays[first] = np.zeros(HUGE_BYTES // 4, dtype=np.float32)
    out = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": content["metrics"],
        }
    )
    if kind == "indices":  # kept channels outside the model, as a pruned reply would carry
        out[KEPT] = ArrayRecord({"no-such-layer": Array(np.array([0, 10**6], dtype=np.int64))})
    elif KEPT in content.array_records:
        out[KEPT] = content.array_records[KEPT]
    return out
