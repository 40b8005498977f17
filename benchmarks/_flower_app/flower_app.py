"""The work of ``benchmarks/perf/sim_overhead.py`` as a plain Flower app, without EdgeFleet.

What a Flower user would write for the same experiment: Flower's FedAvg in a ServerApp,
a ClientApp that trains the device's partition, central evaluation every round. It reuses
EdgeFleet's task code (data, partition, model, ``train_local``, ``evaluate``), so the compute
is the same as EdgeFleet's and the difference between the two is what EdgeFleet's
strategies, screening, rows, checkpoints and device cache cost, and the difference to the
plain-PyTorch floor is what Flower's engine costs.

Timing goes to ``trace-path`` (run config), one JSON object per line: ``first_client_call``
(wall clock at the first handler call of each process), ``round`` (wall clock when a
round's aggregation ends).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from edgefleet.config import RunConfig, parse_run_config
from edgefleet.task.datasets import load_dataset
from edgefleet.task.models import build_model
from edgefleet.task.partition import partition_indices, split_local
from edgefleet.task.train import evaluate, get_arrays, seed_for, set_arrays, train_local

# The keys of EdgeFleet's run config this app reads; the rest is Flower's.
EDGEFLEET_KEYS = ("dataset", "model", "local-steps", "seed", "lr", "batch-size", "momentum")


def run_config(context: Context) -> RunConfig:
    return parse_run_config({k: context.run_config[k] for k in EDGEFLEET_KEYS})


def trace(context: Context, kind: str, **fields: Any) -> None:
    with open(str(context.run_config["trace-path"]), "a") as f:
        f.write(json.dumps({"kind": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def device_data(cfg: RunConfig, n: int, pid: int) -> Any:
    """A device's training set, as ``edgefleet.client.device`` builds it."""
    pool, _, _ = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    d = cfg.data
    idx = partition_indices(pool.y, n, pid, d.partition, alpha=d.alpha,
                            shards_per_partition=d.shards_per_device, seed=cfg.seed)  # fmt: skip
    return split_local(pool.subset(idx), d.local_test_fraction, seed=seed_for(cfg.seed, pid))[0]


def new_model(cfg: RunConfig) -> torch.nn.Module:
    """The ServerApp's seeded initial model."""
    _, _, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    torch.manual_seed(cfg.seed)
    return build_model(cfg.train.model, info.input_shape, info.num_classes)


client = ClientApp()
_seen: set[int] = set()  # processes that have traced their first call
# Per process, as a Flower user keeps a global FederatedDataset, and as EdgeFleet's device
# cache keeps data and model: a model rebuilt per call would be a cost EdgeFleet does not pay.
_data: dict[int, Any] = {}
_model: dict[str, torch.nn.Module] = {}


@client.train()
def train(msg: Message, context: Context) -> Message:
    if os.getpid() not in _seen:
        _seen.add(os.getpid())
        trace(context, "first_client_call")
    torch.set_num_threads(1)  # one Ray actor per core, as EdgeFleet's `client-threads`
    cfg = run_config(context)
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    if "model" not in _model:
        _model["model"] = new_model(cfg)
    model = _model["model"]
    set_arrays(model, msg.content["arrays"])  # type: ignore[arg-type]
    rnd = int(msg.content["config"]["server-round"])  # type: ignore[index]
    t = cfg.train
    if pid not in _data:
        _data[pid] = device_data(cfg, n, pid)
    res = train_local(model, _data[pid], steps=t.local_steps,
                      batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                      seed=seed_for(cfg.seed, pid, rnd))  # fmt: skip
    metrics = MetricRecord({"num-examples": res.num_examples})
    return Message(RecordDict({"arrays": get_arrays(model), "metrics": metrics}), reply_to=msg)


class TimedFedAvg(FedAvg):
    """Flower's FedAvg; notes the wall clock when each round's aggregation ends."""

    def __init__(self, context: Context, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.context = context

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        out = super().aggregate_train(server_round, replies)
        trace(self.context, "round", round=server_round)
        return out


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = run_config(context)
    nodes = int(context.run_config["min-nodes"])
    model = new_model(cfg)
    _, test, _ = load_dataset(cfg.data.dataset, cfg.data.data_dir)

    def evaluate_fn(_: int, arrays: ArrayRecord) -> MetricRecord:
        set_arrays(model, arrays)
        return MetricRecord({"accuracy": evaluate(model, test).accuracy})

    strategy = TimedFedAvg(
        context,
        fraction_train=float(context.run_config["fraction-train"]),
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=nodes,
    )
    strategy.start(
        grid=grid,
        initial_arrays=get_arrays(model),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=evaluate_fn,
    )
