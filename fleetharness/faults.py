"""Deliberately bad train replies, for testing the server's screening (never in production).

:func:`fault_mod` is a Flower mod that lets the device train honestly and then spoils its
train reply in one way; ``cycle`` takes a different way every round. EdgeFleet's own
ClientApp (``edgefleet.client.app:app``) never adds it: only tests and benchmarks do, with
a ClientApp of their own (:func:`faulty_clientapp`, or the component
``fleetharness.faults:faulty_app``). Which devices lie:

- a node whose node config holds ``test-corrupt=KIND`` (a SuperNode's ``--node-config``);
- else, in simulation (where a node's config holds only its partition), the partitions
  the mod was built with: ``fault_mod(kind, partitions)``, or for ``faulty_app`` the
  environment variable ``EDGEFLEET_TEST_FAULTS=KIND:P,P,...`` (read when the module is
  imported; :func:`faults_env` writes it). The run config has no fault keys, so a run or a
  deployment cannot ask for faults, and a SuperNode's ``test-corrupt`` does nothing under
  EdgeFleet's own ClientApp.

A node whose node config holds ``test-slow-s=SECONDS`` answers every train message that
much later (a straggler on a slow link or a slow board; ``tests/test_deployment_async.py``).

The server must drop each such reply with its reason (or, for ``bad-metrics``, leave the
odd metrics out of the average) and finish the run with the honest devices.

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

import math
import os
import time
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import MessageType

from edgefleet.client.app import clientapp
from edgefleet.client.mods import ERR_BAD_CONFIG
from edgefleet.pruning.wire import KEPT
from edgefleet.wire import DEVICE_ID

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
SLOW_KEY = "test-slow-s"  # node config: seconds a train reply is held back
MAX_SLOW_S = 3600.0
FAULTS_ENV = "EDGEFLEET_TEST_FAULTS"
FAULTY_APP = "fleetharness.faults:faulty_app"  # the component string of faulty_app
HUGE_BYTES = 64 * 2**20  # big enough to hurt a server that trusts sizes, small enough for gRPC


def _check_kind(kind: str, where: str) -> None:
    if kind != "cycle" and kind not in KINDS:
        raise ValueError(f"{where}={kind!r}; valid choices: cycle, {', '.join(KINDS)}")


def fault_mod(kind: str = "", partitions: Iterable[int] = ()) -> Mod:
    """A mod that spoils the train reply of a lying device as :func:`corrupt` does: every
    node whose node config holds ``test-corrupt=KIND`` lies as KIND, every other node whose
    ``partition-id`` is in ``partitions`` lies as ``kind``. Other messages, Error replies
    and honest devices pass untouched. Bad settings raise here; a bad ``test-corrupt`` in a
    node config becomes an Error reply naming the valid kinds."""
    liars = tuple(int(p) for p in partitions)
    if bool(kind) != bool(liars):
        raise ValueError(
            f"fault_mod(kind={kind!r}, partitions={liars}): give both a kind and the "
            "partitions that lie as it, or neither (then only a node config's "
            f"{NODE_CONFIG_KEY} makes a device lie)"
        )
    if kind:
        _check_kind(kind, "fault_mod kind")

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
            return reply
        raw = context.node_config.get(SLOW_KEY, 0.0)
        try:
            slow = float(raw)
        except (TypeError, ValueError):
            slow = math.nan
        if not (math.isfinite(slow) and 0.0 <= slow <= MAX_SLOW_S):
            why = f"node config {SLOW_KEY}={raw!r}: must be seconds in [0, {MAX_SLOW_S:g}]"
            return Message(Error(ERR_BAD_CONFIG, why), reply_to=msg)
        time.sleep(slow)
        if reply.has_error():
            return reply
        fault = context.node_config.get(NODE_CONFIG_KEY)
        if not fault and int(context.node_config.get("partition-id", -1)) in liars:
            fault = kind
        if not fault:
            return reply
        server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        try:
            content = corrupt(reply.content, str(fault), server_round)
        except ValueError as err:
            return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
        return Message(content=content, reply_to=msg)

    return mod


def faulty_clientapp(kind: str = "", partitions: Iterable[int] = ()) -> ClientApp:
    """EdgeFleet's ClientApp with ``fault_mod(kind, partitions)`` inside its battery mod,
    where a lying device's train function would spoil its reply."""
    return clientapp(fault_mod(kind, partitions))


def faults_env(kind: str, partitions: Iterable[int]) -> str:
    """The value of ``EDGEFLEET_TEST_FAULTS`` that makes ``faulty_app`` lie as ``kind`` on
    ``partitions``."""
    liars = tuple(int(p) for p in partitions)
    fault_mod(kind, liars)  # checks them
    return f"{kind}:{','.join(map(str, liars))}"


def parse_faults_env(text: str) -> tuple[str, tuple[int, ...]]:
    """``KIND:P,P,...`` (``EDGEFLEET_TEST_FAULTS``) as ``(kind, partitions)``; "" is none."""
    if not text.strip():
        return "", ()
    kind, sep, listed = text.partition(":")
    try:
        liars = tuple(int(p) for p in listed.split(",") if p.strip())
    except ValueError:
        liars = ()
    if not sep or not liars:
        raise ValueError(
            f"{FAULTS_ENV}={text!r}: must be KIND:P,P,... (a fault kind and the partition "
            "ids that lie as it, e.g. nan:2,5)"
        )
    _check_kind(kind.strip(), FAULTS_ENV)
    return kind.strip(), liars


def corrupt(content: RecordDict, kind: str, server_round: int) -> RecordDict:
    """``content`` (a train reply) spoiled as ``kind`` says."""
    _check_kind(kind, f"node config {NODE_CONFIG_KEY}")
    if kind == "cycle":
        kind = KINDS[(server_round - 1) % len(KINDS)]
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
        own = int(metrics.get(DEVICE_ID, 0))
        metrics[DEVICE_ID] = own - 1 if own > 0 else own + 1
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


# For a Flower engine, which loads a ClientApp by its component string (FAULTY_APP): its
# faults come from node configs and from EDGEFLEET_TEST_FAULTS.
faulty_app = faulty_clientapp(*parse_faults_env(os.environ.get(FAULTS_ENV, "")))
