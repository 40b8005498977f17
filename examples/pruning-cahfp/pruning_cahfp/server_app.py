"""The ServerApp: Flower's quickstart with EdgeFleet's strategy line.

``SubmodelReconstruction`` lets devices that can afford only part of the model train a
pruned submodel (CA-HFP, arXiv 2603.12591): it checks every compact reply against the
model's channel groups, scatters it back into the full parameter space (the channels a
device dropped are filled from the global model it was sent) and hands the rebuilt, full-size
replies to Flower's ``FedAvg``. Full-size replies pass through untouched.
"""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result

from edgefleet.strategies import SubmodelReconstruction
from pruning_cahfp.task import Net, load_test, pruning_plan, test

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

    # The plan is built from the model class when the first compact reply arrives: the
    # server needs it only where some device prunes.
    strategy = SubmodelReconstruction(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0), plan_factory=pruning_plan
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
