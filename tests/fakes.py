"""Shared test fakes: the in-process engine's grid over hand-made nodes (to drive the round
loop without Flower's engines), records, replies and a no-op central evaluation."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from edgefleet.loop.context import RoundContext, in_round
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import RoundCallback, RoundResult
from edgefleet.simulation.inprocess import Handler, InProcessGrid, answer

S = TypeVar("S")


class FakeGrid(InProcessGrid):
    """The in-process engine's grid over hand-written nodes: ``handlers[node_id](msg)`` is
    the reply (None: the node never answers); ``sent`` keeps every message delivered."""

    def __init__(self, handlers: dict[int, Handler]) -> None:
        super().__init__(handlers)
        self.sent: list[Message] = []

    def deliver(self, messages: list[Message]) -> list[Message | None]:
        self.sent.extend(messages)
        return super().deliver(messages)


def rec(arrays: Mapping[str, np.ndarray] | None = None, **named: np.ndarray) -> ArrayRecord:
    """An ArrayRecord of float32 arrays: ``rec({"w": ...})`` or ``rec(w=..., b=...)``."""
    items = {**(arrays or {}), **named}
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in items.items()})


def no_eval(rnd: int, arrays: ArrayRecord) -> dict[str, float]:
    """A central evaluation that costs nothing and says nothing."""
    return {"test_accuracy": 0.5, "test_loss": 1.0}


def train_reply(msg: Message, arrays: ArrayRecord, n: int, **metrics: float) -> Message:
    """A train reply as EdgeFleet's ClientApp shapes it: ``arrays`` + ``metrics`` holding
    ``num-examples`` and whatever else is given (``device-id``, ``energy-spent``, ...)."""
    record = MetricRecord({"num-examples": n, **metrics})
    return Message(RecordDict({"arrays": arrays, "metrics": record}), reply_to=msg)


@contextmanager
def by_hand(rnd: int, registry: DeviceRegistry | None = None) -> Iterator[RoundContext]:
    """A round's context for calling a wrapper's configure/aggregate by hand, as the round
    loop would (pass one registry to keep device bindings between rounds)."""
    with in_round(RoundContext(rnd, registry if registry is not None else DeviceRegistry())) as c:
        yield c


class Rows(RoundCallback):
    """Keeps every round's result; ``last(Section)`` is the last round's section."""

    def __init__(self) -> None:
        self.results: list[RoundResult] = []

    def after_round(self, result: RoundResult) -> str | None:
        self.results.append(result)
        return None

    def last(self, section: type[S]) -> S:
        return self.results[-1].context.section(section)


class UploadingGrid(InProcessGrid):
    """Flower's deployment grid as it pulls: a reply is found as soon as its header is in,
    and the same ``pull_messages`` call then waits for its arrays. Node ``slow``'s arrays
    arrive only when ``uploaded`` is set (or after ``limit`` seconds)."""

    synchronous = False

    def __init__(self, handlers: dict[int, Handler], slow: int, limit: float) -> None:
        super().__init__(handlers)
        self.slow, self.limit = slow, limit
        self.uploaded = threading.Event()

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        out = []
        for mid in list(message_ids):
            msg = self._pushed.pop(mid, None)
            if msg is None:
                continue
            if msg.metadata.dst_node_id == self.slow:
                self.uploaded.wait(self.limit)  # the call waits out the upload
            if (reply := answer(self.handlers[msg.metadata.dst_node_id], msg)) is not None:
                out.append(reply)
        return out
