"""EdgeFleet's own ServerApp and ClientApp in one process, without Flower's engines.

The ServerApp's ``main`` drives a grid that hands each message straight to the ClientApp's
``status`` or ``train`` handler of the node it is addressed to; every node keeps its own
``Context`` (battery state) as a SuperNode would. Same code, same seeds, same selection as a
run on the Simulation Engine, minus Ray's start-up (about 30 s) and per-round dispatch, and
with the devices trained one after the other. Use it for sweeps of many runs on a small
machine; ``edgefleet run`` remains the reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from edgefleet.client.app import status, train
from edgefleet.config import DEFAULTS
from edgefleet.server.app import main as server_main


class InProcessGrid:
    """A Grid whose nodes are ClientApp handlers called in this process."""

    def __init__(self, contexts: dict[int, Context]) -> None:
        # Building a Message needs the ids of the task that sends it.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        self.contexts = contexts

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for msg in messages:
            context = self.contexts[msg.metadata.dst_node_id]
            kind = msg.metadata.message_type
            if kind == MessageType.QUERY:
                replies.append(status(msg, context))
            elif kind == MessageType.TRAIN:
                replies.append(train(msg, context))
            else:
                raise ValueError(f"message type {kind!r} is not served in process")
        return replies


def run_inprocess(num_nodes: int, run_config: dict[str, Any]) -> None:
    """Run the ServerApp on ``num_nodes`` simulated devices (partition i on node i + 1)."""
    full = {**DEFAULTS, **run_config}
    contexts = {
        i + 1: Context(
            run_id=1,
            node_id=i + 1,
            node_config={"partition-id": i, "num-partitions": num_nodes},
            state=RecordDict(),
            run_config=full,
        )
        for i in range(num_nodes)
    }
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=full)
    server_main(InProcessGrid(contexts), server)  # type: ignore[arg-type]
