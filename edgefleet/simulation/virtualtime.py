"""An in-process grid on a virtual clock: each device takes a set time to answer.

:class:`~edgefleet.simulation.inprocess.InProcessGrid` answers every message from the pull
that asks for it, so all devices look equally fast. The asynchronous loop
(:mod:`edgefleet.loop.asyncloop`) is about devices that are not: here node ``n``'s
k-th message takes ``duration(n, k)`` virtual seconds from its push, and each pull returns
the replies that finish first among those asked for (advancing the clock to that moment),
so a seeded duration table gives one arrival order, every time, without sleeping. Replies
are computed by the node's handler when they are delivered (a handler sees its messages in
the order they finish). :meth:`clock` is the loop's time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message

from edgefleet.simulation.inprocess import Handler, InProcessGrid, answer

Duration = Callable[[int, int], float]  # (node, its k-th message) -> virtual seconds


class VirtualTimeGrid(InProcessGrid):
    """``handlers`` as :class:`InProcessGrid`'s; ``duration(node, k)`` the virtual seconds
    node's k-th message (k from 0) takes to answer."""

    synchronous = False

    def __init__(self, handlers: Mapping[int, Handler], duration: Duration) -> None:
        super().__init__(handlers)
        self.duration = duration
        self.now = 0.0
        self._due: dict[str, float] = {}
        self._count: dict[int, int] = {}

    def clock(self) -> float:
        return self.now

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for mid in ids:
            node = self._pushed[mid].metadata.dst_node_id
            k = self._count.get(node, 0)
            self._count[node] = k + 1
            self._due[mid] = self.now + float(self.duration(node, k))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        asked = [i for i in message_ids if i in self._pushed]
        if not asked:
            return []
        first = min(self._due[i] for i in asked)
        self.now = max(self.now, first)
        # Ties in push order (ids count up), so the order is a function of the durations.
        ready = sorted((i for i in asked if self._due[i] <= first), key=_id_order)
        replies = []
        for mid in ready:
            msg = self._pushed.pop(mid)
            del self._due[mid]
            reply = answer(self.handlers[msg.metadata.dst_node_id], msg)
            if reply is not None:
                replies.append(reply)
        return replies


def _id_order(mid: str) -> int:
    return int(mid.rsplit("-", 1)[-1])
