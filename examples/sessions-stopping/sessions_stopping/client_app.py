"""The ClientApp: Flower's quickstart plus a query function that says whether the device is
present.

The server's sessions wrapper asks every online node each round; a node that answers
``present = 0`` (or does not answer) is left out of the round, and a change in the present
set opens a new session. A real device would answer from its own state (docked, charging,
in range); here partition ``away-partition`` leaves for rounds ``away-from`` to
``away-until`` (exclusive), so the run shows a departure and a return. The query carries the
server's slot clock (``slot`` = round - 1).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sessions_stopping.task import Net, load_data, test, train

app = ClientApp()

torch.set_num_threads(1)


@app.query()
def presence(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    server_round = int(msg.content["config"]["slot"]) + 1
    away = context.node_config["partition-id"] == cfg["away-partition"] and (
        int(cfg["away-from"]) <= server_round < int(cfg["away-until"])
    )
    status = MetricRecord({"present": 0 if away else 1})
    return Message(RecordDict({"status": status}), reply_to=msg)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, parts = context.node_config["partition-id"], context.node_config["num-partitions"]
    x, y = load_data(pid, parts)
    seed = 1000 * int(msg.content["config"]["server-round"]) + pid
    lr = float(msg.content["config"]["lr"])  # the sessions wrapper may lower it (aux rounds)
    loss = train(net, x, y, int(context.run_config["local-epochs"]), lr, seed)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    loss, acc = test(net, x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
