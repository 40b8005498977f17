"""The ServerApp: Flower's quickstart with EdgeFleet's strategy line.

``FedSAG`` is a FedAvg whose server keeps a SAGA memory of every device's last update, so a
device that sits a round out still counts through its memory; ``EnergyAgeSelection`` asks
every node for its battery each round (one light query message) and trains at most
``max-devices`` of those that can pay for a round, the longest-waiting first (EH-FedSAG,
arXiv 2606.18758).
"""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from edgefleet.strategies import EnergyAgeSelection, FedSAG
from energy_fedsag.task import TRAIN_SLOTS, Net, load_test, test

app = ServerApp()


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy of the global model on the server's held-out images."""
    net = Net()
    net.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = test(net, *load_test())
    return MetricRecord({"accuracy": acc, "loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(0)
    initial = ArrayRecord(Net().state_dict())

    strategy = EnergyAgeSelection(
        # Selection hands FedSAG the round's devices (at most M): it trains them all, even
        # one (Flower's defaults would wait for two).
        FedSAG(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=1,
            min_available_nodes=1,
            server_lr=float(cfg["server-lr"]),
        ),
        max_devices=int(cfg["max-devices"]),
        # The battery clock moves on by one round's cost each round (the mod charges it).
        slots_per_round=TRAIN_SLOTS + 1,
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        num_rounds=int(cfg["num-server-rounds"]),
        evaluate_fn=global_evaluate,
    )

    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
    if cfg["results"]:
        write_results(str(cfg["results"]), result)


def write_results(path: str, result: Result) -> None:
    """Per round: the central accuracy and the averaged train metrics, as JSON."""
    rounds = {
        str(r): {"central": dict(m), "train": dict(result.train_metrics_clientapp.get(r, {}))}
        for r, m in result.evaluate_metrics_serverapp.items()
    }
    with open(path, "w") as f:
        json.dump(rounds, f, indent=1)
