"""Deliberately bad train replies, for testing the server's screening (never in production).

A SuperNode started with ``--node-config 'test-corrupt=KIND ...'`` trains honestly and then
spoils its reply in one way; ``cycle`` takes a different way every round. In simulation,
where a node's config holds only its partition, the run-config keys ``test.corrupt`` and
``test.corrupt-partitions`` do the same for the partitions they name. The server must drop
each such reply with its reason (or, for ``bad-metrics``, leave the odd metrics out of the
average) and finish the run with the honest devices.

Kinds, in ``cycle`` order:

- ``nan``: NaN in the first tensor; ``shape``: the first tensor one entry short;
  ``missing-key``: the first tensor left out; ``indices``: kept channels of a layer the
  model lacks; ``huge``: a 64 MiB first tensor; ``dtype``: float64 instead of float32;
- ``inf-examples``: ``num-examples`` = inf; ``huge-examples``: ``num-examples`` = 1e9 with
  every weight zero (a reply that would replace the model under FedAvg);
- ``scaled``: every weight x 1e30 (finite); ``noise``: the weights replaced by Gaussian
  noise of each tensor's shape and spread (finite, well-formed, useless);
- ``spoof-id``: claims the device id of a neighbour (its own minus one, or plus one for
  device 0): someone else's;
- ``bad-metrics``: an extra metric, ``train-loss`` left out and a list-valued metric (as a
  device on another client version might send);
- ``bad-energy``: ``energy-spent`` = -1e6.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from edgefleet.pruning.wire import KEPT

KINDS: tuple[str, ...] = (
    "nan",
    "shape",
    "missing-key",
    "indices",
    "huge",
    "dtype",
    "inf-examples",
    "huge-examples",
    "scaled",
    "noise",
    "spoof-id",
    "bad-metrics",
    "bad-energy",
)
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
    metrics: dict[str, Any] = dict(content.metric_records["metrics"])
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
    elif kind == "inf-examples":
        metrics["num-examples"] = float("inf")
    elif kind == "huge-examples":
        metrics["num-examples"] = 10**9
        arrays = {k: np.zeros_like(v) for k, v in arrays.items()}
    elif kind == "scaled":
        arrays = {k: _scaled(v) for k, v in arrays.items()}
    elif kind == "noise":
        seed = zlib.crc32(f"{metrics.get('device-id')}-{server_round}".encode())
        rng = np.random.default_rng(seed)
        arrays = {k: _noise(v, rng) for k, v in arrays.items()}
    elif kind == "spoof-id":
        own = int(metrics.get("device-id", 0))
        metrics["device-id"] = own - 1 if own > 0 else own + 1
    elif kind == "bad-metrics":
        metrics.pop("train-loss", None)
        metrics["client-version"] = 2.0
        metrics["train-time-s"] = [1.0, 2.0, 3.0]
    elif kind == "bad-energy":
        metrics["energy-spent"] = -1e6
    out = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord(metrics),
        }
    )
    if kind == "indices":  # kept channels outside the model, as a pruned reply would carry
        out[KEPT] = ArrayRecord({"no-such-layer": Array(np.array([0, 10**6], dtype=np.int64))})
    elif KEPT in content.array_records:
        out[KEPT] = content.array_records[KEPT]
    return out


def _scaled(value: np.ndarray) -> np.ndarray:
    if value.dtype.kind != "f":
        return value
    return value * value.dtype.type(1e30)


def _noise(value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if value.dtype.kind != "f":
        return value
    spread = float(value.std()) or 1.0
    return rng.normal(0.0, spread, size=value.shape).astype(value.dtype)
