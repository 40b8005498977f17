"""An in-process stand-in for Flower's Grid, to drive the round loop without Flower's engines."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.supercore.task_identity import TaskIdentity

Handler = Callable[[Message], Message | None]  # None = the node never answers


class FakeGrid:
    """Delivers each message to ``handlers[node_id]`` synchronously."""

    def __init__(self, handlers: dict[int, Handler]) -> None:
        # Building a Message needs the ids of the task that sends it.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        self.handlers = handlers
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.handlers)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            reply = self.handlers[msg.metadata.dst_node_id](msg)
            if reply is not None:
                replies.append(reply)
        return replies
