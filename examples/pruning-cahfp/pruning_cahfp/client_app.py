"""The ClientApp: Flower's quickstart, training a pruned submodel where the device is small.

A device with keep ratio below 1 (from ``keep-ratios``, one per partition in turn, or a
SuperNode's ``--node-config keep-ratio=0.5``) scores every weight of the model it was sent on
two local batches by curvature (gradient and Fisher diagonal: CA-HFP, arXiv 2603.12591),
keeps the best channels of every group that fit its share of the parameters, and trains
that physically smaller copy. It replies with the compact tensors and an ArrayRecord
``kept`` naming the channels it kept, which the server's ``SubmodelReconstruction`` uses to
rebuild the full-size update.
"""

from __future__ import annotations

import functools

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from edgefleet.pruning.importance import weight_scores
from edgefleet.pruning.submodel import PruningPlan
from edgefleet.pruning.wire import KEPT, kept_record
from pruning_cahfp.task import Net, load_data, pruning_plan, test, train

app = ClientApp()

torch.set_num_threads(1)


@functools.cache
def plan() -> PruningPlan:  # traced once per process, on the first pruned round
    return pruning_plan()


def keep_ratio(context: Context) -> float:
    if "keep-ratio" in context.node_config:  # a real device says what it can afford
        return float(context.node_config["keep-ratio"])
    ratios = [float(r) for r in str(context.run_config["keep-ratios"]).split(",")]
    return ratios[int(context.node_config["partition-id"]) % len(ratios)]


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid, parts = context.node_config["partition-id"], context.node_config["num-partitions"]
    x, y = load_data(pid, parts)
    seed = 1000 * int(msg.content["config"]["server-round"]) + pid

    keep = keep_ratio(context)
    model: nn.Module = net
    content = RecordDict()
    if keep < 1.0:
        batches = [(x[:32], y[:32]), (x[32:64], y[32:64])]
        scores = weight_scores(net, batches, criterion="curvature", seed=seed)
        kept = plan().select(plan().group_scores(scores), keep)
        model = plan().extract(net, kept)  # a smaller network: fewer channels, same layers
        content[KEPT] = kept_record(kept)

    lr = float(msg.content["config"]["lr"])
    loss = train(model, x, y, int(context.run_config["local-epochs"]), lr, seed)
    share = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in net.parameters())
    metrics = {"train_loss": loss, "num-examples": len(y), "parameter-share": share}
    content["arrays"] = ArrayRecord(model.state_dict())
    content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    loss, acc = test(net, x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
