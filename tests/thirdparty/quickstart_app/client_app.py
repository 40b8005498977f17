"""The ClientApp, as Flower's quickstart writes it. ``app`` is plain; ``app_with_energy`` adds
EdgeFleet's energy mod (and a query function for its status answers): the only EdgeFleet
import, and the only change. ``app_with_attackers`` adds an EdgeFleet attack mod instead, for
trying defences in simulation: partitions 0 and 1 send their update sign-flipped."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgefleet.attacks import attack_mod
from edgefleet.client.mods import energy_mod, status_query
from quickstart_app.task import Net, load_data, test, train

app = ClientApp()
app_with_energy = ClientApp(mods=[energy_mod(capacity=8, harvest_prob=0.3)])
app_with_energy.query()(status_query)
ATTACKERS = (0, 1)
app_with_attackers = ClientApp(mods=[attack_mod("sign-flip", ATTACKERS)])


def _train(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    seed = 1000 * int(msg.content["config"]["server-round"]) + context.node_config["partition-id"]
    loss = train(net, x, y, context.run_config["local-epochs"], msg.content["config"]["lr"], seed)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


def _evaluate(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    loss, acc = test(net, x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


torch.set_num_threads(1)
for client_app in (app, app_with_energy, app_with_attackers):
    client_app.train()(_train)
    client_app.evaluate()(_evaluate)
