"""The ClientApp: Flower's quickstart plus EdgeFleet's battery mod.

The mod gives the device a battery that harvests energy slot by slot (a unit with
probability ``harvest_prob`` each slot, seeded per device) and charges every round it
trains ``train_slots + 1`` units. It answers the server's status query with the battery's
level (``status_query`` is the query function it completes: Flower runs mods only around
functions the app registered) and declines a train message the battery cannot pay for,
spending nothing. ``train`` and ``evaluate`` are the quickstart's own.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgefleet.client.mods import energy_mod, status_query
from energy_fedsag.task import TRAIN_SLOTS, Net, load_data, test, train

# The mod's settings are the device's hardware, fixed when the app is loaded.
app = ClientApp(mods=[energy_mod(capacity=8, harvest_prob=0.4, train_slots=TRAIN_SLOTS)])
app.query()(status_query)

torch.set_num_threads(1)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, parts = context.node_config["partition-id"], context.node_config["num-partitions"]
    x, y = load_data(pid, parts)
    seed = 1000 * int(msg.content["config"]["server-round"]) + pid
    lr = float(msg.content["config"]["lr"])
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
